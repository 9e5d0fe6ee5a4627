#!/usr/bin/env bash
# Spark 4 needs Java 17 or newer. Say so clearly instead of letting pyspark fail deep inside py4j.
set -euo pipefail
java_bin="${JAVA_HOME:+$JAVA_HOME/bin/}java"
if ! command -v "$java_bin" >/dev/null 2>&1; then
    echo "check_java: Java not found. Spark (pyspark 4) needs Java 17+: apt-get install -y openjdk-17-jre-headless, or set JAVA_HOME" >&2
    exit 1
fi
version="$("$java_bin" -version 2>&1 | awk -F'"' '/version/ {print $2; exit}')"
major="${version%%.*}"
if [ "${major:-0}" -lt 17 ] 2>/dev/null; then
    echo "check_java: Java $version found; Spark (pyspark 4) needs Java 17+" >&2
    exit 1
fi
echo "check_java: Java $version"
