// Umbrella header of the gradcomp core: codecs, wire format, backends, collectives, the engine.
#pragma once

#include "gradcomp/all_gather.h"
#include "gradcomp/backend.h"
#include "gradcomp/codec_spec.h"
#include "gradcomp/collectives.h"
#include "gradcomp/communicator.h"
#include "gradcomp/cpu.h"
#include "gradcomp/engine.h"
#include "gradcomp/format.h"
#include "gradcomp/inprocess_group.h"
#include "gradcomp/launch_env.h"
#include "gradcomp/outer_short_run.h"
#include "gradcomp/outer_sync.h"
#include "gradcomp/reduce_scatter.h"
#include "gradcomp/shm_communicator.h"
#include "gradcomp/types.h"
#if defined(GRADCOMP_HAVE_CUDA)
#include "gradcomp/cuda.h"
#endif
