"""`%load_ext dtrain_magic` registers %%distribute, and `%%distribute?` shows every flag with its default."""

from IPython.core.interactiveshell import InteractiveShell


def test_help_through_a_real_shell(capsys):
    shell = InteractiveShell.instance()
    shell.run_cell("%load_ext dtrain_magic", store_history=False)
    assert "distribute" in shell.magics_manager.magics["cell"]
    shell.run_cell("%%distribute?", store_history=False)
    shown = capsys.readouterr().out
    for fragment in ["--backend", "(default: auto)", "--zero", "--num-workers", "--grad-accum", "(default: 1)",
                     "--tracking-uri", "--dry-run", "--ray-address", "--deepspeed-config", "(default: dtrain_magic)"]:
        assert fragment in shown, fragment
