"""The sparse optimizers' rules, as WholeMemory defines them: their names, parameters with
defaults, the state each keeps per row, and the update of a set of distinct rows from their
summed gradients. Pure: rows in, rows out; where the rows live is the embedding's business.

- sgd (weight_decay 0): g += wd * w; w -= lr * g
- adam, lazy (weight_decay 0, epsilon 1e-8, beta1 0.9, beta2 0.999, adam_w 0): each row keeps
  m, v and beta12t = (beta1^t, beta2^t) over the steps t that touched it, so bias correction
  counts a row's own steps and untouched rows keep their state. adam_w > 0.5 decays the weight
  (w -= lr * wd * w) instead of adding wd * w to the gradient.
- adagrad (weight_decay 0, epsilon 1e-8): state_sum += g^2; w -= lr * g / (sqrt(state_sum) + eps)
- rmsprop (weight_decay 0, epsilon 1e-8, alpha 0.99): v = alpha v + (1 - alpha) g^2;
  w -= lr * g / (sqrt(v) + eps)

All in float32, the only dtype a trainable embedding has.
"""

from __future__ import annotations

import numbers

import torch

from .tensor import fail


class Rule:
    """One optimizer: its WholeMemory name, parameters and defaults, and its states as
    (name, width: "dim" or a number, initial value, cachable: per element of the row)."""

    def __init__(self, name: str, defaults: dict, states: list[tuple]):
        self.name, self.defaults, self.states = name, defaults, states

    @property
    def state_names(self) -> list[str]:
        return [s[0] for s in self.states]

    def params(self, op: str, group, param_dict) -> dict:
        """The defaults overridden by param_dict; an unknown name or a value that is not a number is
        an error naming it."""
        if param_dict is None:
            param_dict = {}
        if not isinstance(param_dict, dict):
            fail(op, group, f"param_dict must be a dict of parameter names to numbers, got "
                 f"{type(param_dict).__name__}", TypeError)
        out = dict(self.defaults)
        for key, value in param_dict.items():
            if key not in self.defaults:
                known = ", ".join(self.defaults) or "none"
                fail(op, group, f"parameter name {key!r} is not valid for optimizer {self.name} "
                     f"(its parameters: {known})")
            if not isinstance(value, numbers.Real):
                fail(op, group, f"parameter {key!r} of optimizer {self.name} must be a number, got {value!r}",
                     TypeError)
            out[key] = float(value)
        return out


RULES = {
    "sgd": Rule("SGD", {"weight_decay": 0.0}, []),
    "adam": Rule("LazyAdam", {"weight_decay": 0.0, "epsilon": 1e-8, "beta1": 0.9, "beta2": 0.999, "adam_w": 0.0},
                 [("m", "dim", 0.0, True), ("v", "dim", 0.0, True), ("beta12t", 2, 1.0, False)]),
    "adagrad": Rule("AdaGrad", {"weight_decay": 0.0, "epsilon": 1e-8}, [("state_sum", "dim", 0.0, True)]),
    "rmsprop": Rule("RMSProp", {"weight_decay": 0.0, "epsilon": 1e-8, "alpha": 0.99}, [("v", "dim", 0.0, True)]),
}


def rule(op: str, group, optimizer_type) -> Rule:
    r = RULES.get(optimizer_type) if isinstance(optimizer_type, str) else None
    if r is None:
        fail(op, group, f"WholeMemory optimizer {optimizer_type!r} not supported, should be "
             f"({', '.join(RULES)})")
    return r


def update(kind: str, p: dict, w: torch.Tensor, g: torch.Tensor, states: dict, lr: float):
    """The new rows and states of distinct rows ``w`` (float32, [k, dim]) given the sums of their
    gradients ``g``. ``w``, ``g`` and the states are the caller's copies: updated in place and
    returned as (w, {state name: rows})."""
    lr = float(lr)
    wd = p["weight_decay"]
    if kind == "adam" and p["adam_w"] > 0.5:
        if wd:
            w.mul_(1 - lr * wd)  # w -= lr * wd * w
    elif wd:
        g.add_(w, alpha=wd)  # g += wd * w
    if kind == "sgd":
        return w.sub_(g, alpha=lr), {}
    if kind == "adam":
        beta1, beta2, eps = p["beta1"], p["beta2"], p["epsilon"]
        bt = states["beta12t"].mul_(torch.tensor([beta1, beta2], dtype=torch.float32, device=w.device))
        m = states["m"].mul_(beta1).add_(g, alpha=1 - beta1)
        v = states["v"].mul_(beta2).addcmul_(g, g, value=1 - beta2)
        denom = (v / (1 - bt[:, 1:])).sqrt_().add_(eps)  # sqrt(vhat) + eps
        w.addcdiv_(m / (1 - bt[:, :1]), denom, value=-lr)  # w -= lr * mhat / (sqrt(vhat) + eps)
        return w, {"m": m, "v": v, "beta12t": bt}
    if kind == "adagrad":
        s = states["state_sum"].addcmul_(g, g)
        w.addcdiv_(g, s.sqrt().add_(p["epsilon"]), value=-lr)
        return w, {"state_sum": s}
    if kind == "rmsprop":
        alpha = p["alpha"]
        v = states["v"].mul_(alpha).addcmul_(g, g, value=1 - alpha)
        w.addcdiv_(g, v.sqrt().add_(p["epsilon"]), value=-lr)
        return w, {"v": v}
    raise AssertionError(kind)
