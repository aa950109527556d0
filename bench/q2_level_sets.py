"""Why q2 has four levels without zero: relative L2 error of the two 2-bit level sets, blocks of 64.

A model of the rules in plain PyTorch (the bf16 rounding of q2's step is left out): four levels (c - 1.5) d with
d = absmax / 1.5, against ternary {-1, 0, 1} * absmax (the fourth code spare), each with round to nearest and
stochastic rounding, on (1) a DiLoCo outer gradient (an MLP after H = 20 AdamW steps), (2) normal values, (3)
normal values with 0.1 % 20x outliers. Run: python bench/q2_level_sets.py (CPU, a few seconds).
"""
import torch
import torch.nn as nn


def outer_gradient():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))
    start = torch.cat([p.detach().reshape(-1).clone() for p in m.parameters()])
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    for _ in range(20):
        x, y = torch.randn(64, 256), torch.randint(0, 10, (64,))
        opt.zero_grad()
        nn.functional.cross_entropy(m(x), y).backward()
        opt.step()
    return start - torch.cat([p.detach().reshape(-1) for p in m.parameters()])


def errors(values, block=64):
    xb = values[: values.numel() // block * block].view(-1, block)
    a = xb.abs().max(dim=1, keepdim=True).values.clamp_min(1e-30)
    gen = torch.Generator().manual_seed(1)

    def sr(t):
        fl = t.floor()
        return fl + (torch.rand(t.shape, generator=gen) < (t - fl)).float()

    def rel(y):
        return ((y - xb).norm() / xb.norm()).item()

    d = a / 1.5
    u = (xb / d + 1.5).clamp(0, 3)
    t = (xb / a).clamp(-1, 1)
    return rel((u.round() - 1.5) * d), rel((sr(u) - 1.5) * d), rel(t.round() * a), rel(sr(t) * a)


def main():
    torch.manual_seed(0)
    n = 1 << 20
    outliers = torch.randn(n)
    outliers[torch.randperm(n)[: n // 1000]] *= 20
    print("| values | four levels RN | four levels SR | ternary RN | ternary SR |")
    print("|---|---|---|---|---|")
    for name, v in (("DiLoCo outer gradient (MLP, H = 20 AdamW steps)", outer_gradient()),
                    ("normal", torch.randn(n)), ("normal, 0.1 % 20x outliers", outliers)):
        print(f"| {name} | " + " | ".join(f"{e:.3f}" for e in errors(v)) + " |")


if __name__ == "__main__":
    main()
