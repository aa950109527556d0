// DiLoCo's outer step per element: the outer gradient and the outer optimizer's Nesterov SGD.
#pragma once

#include "float_ops.h"

namespace gradcomp {
namespace math {

// The outer gradient of one element: where the round started minus where the inner steps went.
GRADCOMP_HD float outer_gradient(float anchor, float param) {
  return sub_rn(anchor, param);
}

// SGD with momentum on the averaged outer gradient g, as torch.optim.SGD computes it (dampening
// 0; a zero-initialised buffer gives its first step's buffer = g): buf = momentum * buf + g, the
// update is g + momentum * buf with Nesterov and buf without; returns the new anchor
// anchor - lr * update and updates *buf.
GRADCOMP_HD float outer_sgd(float anchor, float g, float* buf, float lr, float momentum,
                            bool nesterov) {
  const float b = add_rn(mul_rn(*buf, momentum), g);
  *buf = b;
  const float update = nesterov ? add_rn(g, mul_rn(b, momentum)) : b;
  return sub_rn(anchor, mul_rn(update, lr));
}

// Streaming DiLoCo's merge of a fragment whose round arrived late: alpha * local + (1 - alpha) *
// global, each product rounded on its own (as two tensor multiplies and an add compute it).
GRADCOMP_HD float outer_mix(float local, float global, float alpha) {
  return add_rn(mul_rn(alpha, local), mul_rn(sub_rn(1.0f, alpha), global));
}

// Eager updates' merge: the parameters went on from the eager anchor (this rank's own outer step)
// for tau inner steps; the late global anchor replaces it and that progress stays: local +
// (global - eager), the difference rounded first.
GRADCOMP_HD float outer_eager_correct(float local, float global, float eager) {
  return add_rn(local, sub_rn(global, eager));
}

}  // namespace math
}  // namespace gradcomp
