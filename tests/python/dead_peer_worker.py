"""One rank of the dead-peer test, as a program of its own so that its exit code is what a
training script's would be: `python dead_peer_worker.py RANK WORLD STORE VICTIM PHASE PAUSE REPORT [DEADLINE]`.
A survivor writes what it saw to REPORT and exits non-zero with the error."""
import datetime
import json
import os
import sys

import torch.distributed as dist

import workers_faults


def main(rank, world, store, victim, phase, pause_file, report, deadline=None):
    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=20))
    if phase == "diloco_round_in_flight":
        seen = workers_faults.diloco_survives_a_dead_peer(rank, world, victim, pause_file)
    else:
        seen = workers_faults.survive_a_dead_peer(rank, world, victim, phase, pause_file, deadline)
    with open(report + ".tmp", "w") as f:  # whole, or not there: the test reads it while we exit
        json.dump(seen, f)
    os.replace(report + ".tmp", report)
    raise SystemExit(f"rank {rank}: {seen['error']}")


if __name__ == "__main__":
    a = sys.argv[1:]
    main(int(a[0]), int(a[1]), a[2], int(a[3]), a[4], a[5], a[6], float(a[7]) if len(a) > 7 else None)
