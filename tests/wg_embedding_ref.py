"""What the embedding tests compare with: WholeMemory's sparse optimizers written out for one
process holding the whole table (float64), and the data every rank feeds them (the same on every
rank and in the reference, so each rank can compute what all of them did)."""

from __future__ import annotations

import torch

ROWS, DIM, HOT = 70, 6, 50  # rows >= HOT are never touched
LR = 0.05

CONFIGS = [  # (optimizer, param_dict): defaults, and every parameter moved
    ("sgd", {}),
    ("sgd", {"weight_decay": 0.1}),
    ("adam", {}),
    ("adam", {"weight_decay": 0.05, "epsilon": 1e-6, "beta1": 0.8, "beta2": 0.99}),
    ("adam", {"adam_w": 1.0, "weight_decay": 0.2}),
    ("adagrad", {"weight_decay": 0.01, "epsilon": 1e-6}),
    ("rmsprop", {}),
    ("rmsprop", {"alpha": 0.9, "weight_decay": 0.02}),
]

DEFAULTS = {"sgd": {"weight_decay": 0.0},
            "adam": {"weight_decay": 0.0, "epsilon": 1e-8, "beta1": 0.9, "beta2": 0.999, "adam_w": 0.0},
            "adagrad": {"weight_decay": 0.0, "epsilon": 1e-8},
            "rmsprop": {"weight_decay": 0.0, "epsilon": 1e-8, "alpha": 0.99}}
STATES = {"sgd": [], "adam": ["m", "v", "beta12t"], "adagrad": ["state_sum"], "rmsprop": ["v"]}


def init_table(rows: int = ROWS, dim: int = DIM) -> torch.Tensor:
    return torch.randn(rows, dim, generator=torch.Generator().manual_seed(5)) * 0.5


def batch(step: int, rank: int, hot: int = HOT):
    """A rank's ids at a step: repeats within the rank, a row every rank touches, rows other ranks
    touch too; never a row >= hot."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    ids = torch.randint(0, hot, (6 + rank,), generator=g)
    return torch.cat([ids, ids[:2], torch.tensor([(7 * step) % hot])])


def weights(step: int, rank: int, k: int, dim: int = DIM) -> torch.Tensor:
    """d loss / d output of a rank's lookup (loss = (output * weights).sum())."""
    return torch.randn(k, dim, generator=torch.Generator().manual_seed(7000 + 1000 * step + rank))


class Reference:
    """One process's embedding and optimizer: gradients of every rank summed per row, one step
    per touched row, as WholeMemory defines the rules."""

    def __init__(self, kind: str, params: dict, table: torch.Tensor):
        self.kind = kind
        self.p = dict(DEFAULTS[kind], **params)
        self.w = table.double().clone()
        rows, dim = self.w.shape
        self.states = {}
        if kind == "adam":
            self.states = {"m": torch.zeros(rows, dim, dtype=torch.float64),
                           "v": torch.zeros(rows, dim, dtype=torch.float64),
                           "beta12t": torch.ones(rows, 2, dtype=torch.float64)}
        elif kind == "adagrad":
            self.states = {"state_sum": torch.zeros(rows, dim, dtype=torch.float64)}
        elif kind == "rmsprop":
            self.states = {"v": torch.zeros(rows, dim, dtype=torch.float64)}

    def step(self, ids: torch.Tensor, grads: torch.Tensor, lr: float) -> None:
        total = torch.zeros_like(self.w).index_add_(0, ids, grads.double())
        p, s = self.p, self.states
        for row in torch.unique(ids).tolist():
            w, g = self.w[row], total[row]
            wd = p["weight_decay"]
            if self.kind == "sgd":
                g = g + wd * w
                self.w[row] = w - lr * g
            elif self.kind == "adam":
                b1, b2 = p["beta1"], p["beta2"]
                s["beta12t"][row, 0] *= b1
                s["beta12t"][row, 1] *= b2
                if p["adam_w"] > 0.5:
                    w = w - lr * wd * w
                else:
                    g = g + wd * w
                s["m"][row] = b1 * s["m"][row] + (1 - b1) * g
                s["v"][row] = b2 * s["v"][row] + (1 - b2) * g * g
                mhat = s["m"][row] / (1 - s["beta12t"][row, 0])
                vhat = s["v"][row] / (1 - s["beta12t"][row, 1])
                self.w[row] = w - lr * mhat / (vhat.sqrt() + p["epsilon"])
            elif self.kind == "adagrad":
                g = g + wd * w
                s["state_sum"][row] += g * g
                self.w[row] = w - lr * g / (s["state_sum"][row].sqrt() + p["epsilon"])
            else:
                g = g + wd * w
                s["v"][row] = p["alpha"] * s["v"][row] + (1 - p["alpha"]) * g * g
                self.w[row] = w - lr * g / (s["v"][row].sqrt() + p["epsilon"])

    def train_step(self, step: int, n: int, lr: float = LR, hot: int = HOT) -> None:
        """Every rank's batch and weights of a step."""
        ids = [batch(step, r, hot) for r in range(n)]
        self.step(torch.cat(ids), torch.cat([weights(step, r, len(i), self.w.shape[1]) for r, i in enumerate(ids)]), lr)


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.allclose(a.double().cpu(), b.double().cpu(), rtol=1e-4, atol=2e-5)
