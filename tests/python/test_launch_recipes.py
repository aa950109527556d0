"""The launch recipes of examples/launch run for real: torchrun on one node and across two
"nodes" of this machine, sbatch on a single-node Slurm (Debian's slurmctld and slurmd, configured
here on 127.0.0.1), and the Kubernetes manifests pass the API schema's strict validation."""
import os
import pathlib
import re
import shutil
import socket
import subprocess
import sys
import time

import pytest
import yaml

ROOT = pathlib.Path(__file__).resolve().parents[2]
LAUNCH = ROOT / "examples" / "launch"


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(**extra):
    # The recipes start `python3` from PATH: the test's interpreter.
    env = dict(os.environ, PYTHON=sys.executable, OMP_NUM_THREADS="1", **extra)
    env["PATH"] = f"{pathlib.Path(sys.executable).parent}:{env.get('PATH', '')}"
    return env


def _accuracy(output):
    found = re.search(r"codec=q4 test accuracy ([0-9.]+)", output)
    assert found, output[-3000:]
    return float(found.group(1))


def test_torchrun_single_node_recipe_trains_digits():
    r = subprocess.run([str(LAUNCH / "torchrun_single_node.sh"), "--codec", "q4", "--epochs", "10"],
                       env=_env(NPROC="2", METRICS_PORT=str(_free_port())), capture_output=True, text=True,
                       timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert _accuracy(r.stdout) > 0.9


def test_torchrun_multi_node_recipe_rendezvous_of_two_nodes():
    rdzv = str(_free_port())
    # Both "nodes" are this machine: each serves its metrics on a port of its own.
    envs = [_env(HEAD="127.0.0.1", RDZV_PORT=rdzv, NNODES="2", NPROC="1", JOB_ID="recipe-test",
                 METRICS_PORT=str(_free_port()), NCCL_SOCKET_IFNAME="lo") for _ in range(2)]
    nodes = [subprocess.Popen([str(LAUNCH / "torchrun_multi_node.sh"), "--codec", "q4", "--epochs", "10"], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT) for env in envs]
    outs = [n.communicate(timeout=300) for n in nodes]
    for n, (out, err) in zip(nodes, outs):
        assert n.returncode == 0, out[-2000:] + err[-3000:]
    assert _accuracy("".join(o for o, _ in outs)) > 0.9


@pytest.fixture
def slurm(tmp_path):
    """slurmctld and slurmd for this machine alone (auth/none: nothing leaves 127.0.0.1)."""
    for tool in ("slurmctld", "slurmd", "sbatch"):
        assert shutil.which(tool), f"{tool} not found: scripts/setup.sh installs Debian's slurmctld and slurmd"
    assert os.geteuid() == 0, "the Slurm test runs its daemons as root, as CI does"
    host = socket.gethostname()
    for d in ("state", "spool", "log"):
        (tmp_path / d).mkdir()
    conf = tmp_path / "slurm.conf"
    conf.write_text(f"""ClusterName=gradcomp-test
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={_free_port()}
SlurmdPort={_free_port()}
AuthType=auth/none
CredType=cred/none
SlurmUser=root
SlurmdUser=root
StateSaveLocation={tmp_path}/state
SlurmdSpoolDir={tmp_path}/spool
SlurmctldPidFile={tmp_path}/slurmctld.pid
SlurmdPidFile={tmp_path}/slurmd.pid
SlurmctldLogFile={tmp_path}/log/slurmctld.log
SlurmdLogFile={tmp_path}/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
NodeName={host} NodeAddr=127.0.0.1 CPUs={os.cpu_count()} State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
""")
    env = dict(os.environ, SLURM_CONF=str(conf))
    daemons = [subprocess.Popen([shutil.which(d), "-D", "-f", str(conf)], env=env, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL) for d in ("slurmctld", "slurmd")]
    deadline = time.time() + 60
    while time.time() < deadline:
        r = subprocess.run(["sinfo", "-h", "-o", "%t"], env=env, capture_output=True, text=True)
        if r.returncode == 0 and r.stdout.strip() in ("idle", "mix", "alloc"):
            break
        time.sleep(1)
    else:
        pytest.fail(f"Slurm did not come up: {(tmp_path / 'log' / 'slurmctld.log').read_text()[-2000:]}")
    try:
        yield env
    finally:
        for d in daemons:
            d.terminate()
            d.wait(timeout=30)


def test_the_sbatch_recipe_trains_digits_with_two_tasks_under_srun(slurm, tmp_path):
    out = tmp_path / "job.out"
    r = subprocess.run(["sbatch", "--wait", f"--output={out}", "--export=ALL", str(LAUNCH / "slurm.sbatch"),
                        "--codec", "q4", "--epochs", "10"],
                       env=_env(**slurm, METRICS_PORT=str(_free_port())), capture_output=True, text=True,
                       timeout=600, cwd=ROOT)
    text = out.read_text() if out.exists() else ""
    assert r.returncode == 0, r.stdout + r.stderr + text[-3000:]
    assert _accuracy(text) > 0.9


def _manifests(name):
    return list(yaml.safe_load_all((LAUNCH / "kubernetes" / name).read_text()))


def test_the_kubernetes_manifests_pass_the_api_schema_strictly(tmp_path):
    validate = [sys.executable, "-m", "kubernetes_validate", "--strict", "-k", "1.30.0"]
    r = subprocess.run(validate + [str(LAUNCH / "kubernetes" / "gradcomp-job.yaml")], capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.count("passed") == 2, r.stdout + r.stderr
    # The validator does refuse: a misspelt field fails.
    broken = tmp_path / "broken.yaml"
    broken.write_text((LAUNCH / "kubernetes" / "gradcomp-job.yaml").read_text().replace("completionMode:",
                                                                                      "completionMod:"))
    r = subprocess.run(validate + [str(broken)], capture_output=True, text=True)
    assert r.returncode != 0, r.stdout
    # The PodMonitor (a Prometheus Operator resource the validator has no schema for) selects the
    # Job's pods and names a port they declare.
    service, job = _manifests("gradcomp-job.yaml")
    (monitor,) = _manifests("podmonitor.yaml")
    pod = job["spec"]["template"]
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1" and monitor["kind"] == "PodMonitor"
    assert monitor["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    ports = {p["name"] for c in pod["spec"]["containers"] for p in c["ports"]}
    assert {e["port"] for e in monitor["spec"]["podMetricsEndpoints"]} <= ports
    # Every local rank's port is declared and scraped: torchrun's --nproc-per-node of them.
    nproc = int(re.search(r"--nproc-per-node (\d+)", pod["spec"]["containers"][0]["args"][0]).group(1))
    metrics = {p for p in ports if p.startswith("metrics-")}
    assert len(metrics) == nproc and {e["port"] for e in monitor["spec"]["podMetricsEndpoints"]} == metrics
    assert pod["spec"]["subdomain"] == service["metadata"]["name"] and service["spec"]["clusterIP"] == "None"


def test_a_crashed_job_restarted_by_the_recipe_resumes_bit_for_bit(tmp_path):
    """Checkpoint every 20 steps; a run that dies after 70 steps and is started again (as torchrun's
    --max-restarts, Slurm's --requeue or the Job's backoffLimit would) ends with the very parameters
    of a run that never stopped."""
    def run(*extra):
        return subprocess.run([str(LAUNCH / "torchrun_single_node.sh"), "--codec", "q4", "--epochs", "4", *extra],
                              env=_env(NPROC="2", METRICS_PORT=str(_free_port())), capture_output=True, text=True,
                              timeout=300, cwd=ROOT)

    def digest(r):
        found = re.search(r"parameters sha256 ([0-9a-f]{64})", r.stdout)
        assert found, r.stdout[-2000:] + r.stderr[-2000:]
        return found.group(1)

    straight = run()
    assert straight.returncode == 0, straight.stderr[-3000:]
    ckpt = str(tmp_path / "ckpt")
    crashed = run("--checkpoint", ckpt, "--checkpoint-every", "20", "--stop-after", "70")
    assert crashed.returncode != 0 and pathlib.Path(ckpt + ".rank0").exists()
    resumed = run("--checkpoint", ckpt, "--checkpoint-every", "20")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert digest(resumed) == digest(straight)
