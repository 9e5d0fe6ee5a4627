"""Training cells shared by the backend tests, so every backend is compared on the same function."""

TRAIN_HELPERS = """
import torch

def make_data(n=64, features=8):
    g = torch.Generator().manual_seed(1)
    X = torch.randn(n, features, generator=g)
    return torch.utils.data.TensorDataset(X, X.sum(1, keepdim=True) + 0.1)
"""

# Global batch 16; each rank gets 16 / world_size samples of every global batch (DistributedSampler).
# Returns the final weights (fp32) of rank's model.
TRAIN_CELL = """%%distribute --backend {backend} -n {n} --no-ui {extra}
def train(ctx):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    loader = torch.utils.data.DataLoader(make_data(), batch_size=16 // ctx.world_size)
    model, opt, loader = ctx.prepare(model, opt, loader)
    for epoch in range(3):
        for x, y in loader:
            loss = torch.nn.functional.mse_loss(model(x), y)
            ctx.backward(loss)
            ctx.step()
            ctx.log(loss=loss.item())
    plain = getattr(model, "module", model)
    return {{k: v.detach().clone() for k, v in plain.state_dict().items()}}
"""


def train_cell(backend: str, n: int = 2, extra: str = "") -> str:
    return TRAIN_CELL.format(backend=backend, n=n, extra=extra)
