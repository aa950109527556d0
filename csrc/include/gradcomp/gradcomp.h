// Umbrella header of the gradcomp core: codecs, wire format, CPU/CUDA backends, collectives.
#pragma once

#include "gradcomp/collectives.h"
#include "gradcomp/cpu.h"
#include "gradcomp/format.h"
#include "gradcomp/types.h"
#if defined(GRADCOMP_HAVE_CUDA)
#include "gradcomp/cuda.h"
#endif
