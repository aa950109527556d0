"""DiLoCo with uncompressed fp32 outer gradients, in plain PyTorch: the convergence runs' "-none" baseline."""

import torch
import torch.distributed as dist


class Fp32DiLoCo:
    """gradcomp.torch.diloco's round (one fragment, no overlap) with dist.all_reduce in fp32 in place of the
    compressed allreduce, so that a run beside the q4 one splits a loss gap into the codec's part and
    DiLoCo's own. gradcomp's DiLoCo refuses NoCompression (it exists to compress); this is a measuring
    baseline, not a second DiLoCo. The outer step is kernels/math/outer_math.h's, one rounding per operation:
    g = mean(anchor - param), buf = momentum * buf + g, anchor -= lr * (g + momentum * buf) (Nesterov)."""

    def __init__(self, params, optimizer, inner_steps, outer_lr, outer_momentum, nesterov):
        self.params = list(params)
        self.h, self.lr, self.mu, self.nesterov = inner_steps, outer_lr, outer_momentum, nesterov
        self.world = dist.get_world_size()
        with torch.no_grad():
            for p in self.params:  # as gradcomp's DiLoCo: every rank starts from rank 0's parameters
                dist.broadcast(p, 0)
        self.anchor = [p.detach().float().clone() for p in self.params]
        self.buf = [torch.zeros_like(a) for a in self.anchor]
        self.steps = 0
        self.bytes_sent = 0
        self._handle = optimizer.register_step_post_hook(lambda *_: self.step())

    def step(self):
        self.steps += 1
        if self.steps % self.h:
            return 0
        grads = [a - p.detach().float() for a, p in zip(self.anchor, self.params)]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat)
        flat /= self.world
        # a ring allreduce sends 2 (W - 1) / W of the fp32 bytes per rank
        self.bytes_sent += 2 * (self.world - 1) * flat.numel() * 4 // self.world
        finite = bool(torch.isfinite(flat).all())  # as gradcomp's: a non-finite round leaves the anchors
        at = 0
        with torch.no_grad():
            for i, p in enumerate(self.params):
                g = flat[at:at + p.numel()].view_as(p)
                at += p.numel()
                if finite:
                    self.buf[i] = self.buf[i] * self.mu + g
                    update = g + self.buf[i] * self.mu if self.nesterov else self.buf[i]
                    self.anchor[i] = self.anchor[i] - update * self.lr
                p.copy_(self.anchor[i])
        return 1

    def stats(self):
        return {"bytes_sent": self.bytes_sent}
