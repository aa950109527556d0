"""Operations: the alert rules load and fire in promtool's own tests, the dashboard asks only for
exported metrics, and a real Prometheus server scrapes a real 2-rank DDP run: its values equal the
hook's stats() and the straggler alert fires for the rank made slow on purpose."""
import contextlib
import json
import pathlib
import re
import shutil
import socket
import subprocess
import threading
import time
import urllib.parse
import urllib.request

import gradcomp
import gradcomp.torch as gt
from cpp_trainer import digits_file
from cpp_trainer import launch as launch_trainer
from launcher import launch

ROOT = pathlib.Path(__file__).resolve().parents[2]
MONITORING = ROOT / "monitoring"


def _tool(name):
    path = shutil.which(name)
    assert path, f"{name} not found: scripts/setup.sh installs Debian's prometheus package"
    return path


def test_alert_rules_load_and_fire_in_promtools_tests():
    subprocess.run([_tool("promtool"), "check", "rules", str(MONITORING / "gradcomp.rules.yml")], check=True)
    r = subprocess.run([_tool("promtool"), "test", "rules", "gradcomp.rules.test.yml"], cwd=MONITORING,
                       capture_output=True, text=True)
    assert r.returncode == 0 and "SUCCESS" in r.stdout, r.stdout + r.stderr


def _exported_families():
    """The metric names a hook exports, from the core's text (every front end's is the same)."""
    from prometheus_client.parser import text_string_to_metric_families

    names = set()
    for family in text_string_to_metric_families(_hook_text()):
        names.add(family.name)
        names.update(s.name for s in family.samples)
    return names


def test_every_dashboard_and_rule_query_names_an_exported_metric():
    exported = _exported_families()
    dashboard = json.loads((MONITORING / "grafana-dashboard.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    exprs += [t["query"] for t in dashboard["templating"]["list"] if isinstance(t.get("query"), str)
              and "gradcomp" in t["query"]]
    exprs += re.findall(r"expr: (?:\|\n)?(.*?)(?:\n\s+(?:for|labels):|\n\s+- )",
                        (MONITORING / "gradcomp.rules.yml").read_text(), re.S)
    used = set()
    for e in exprs:
        used.update(re.findall(r"\bgradcomp_[a-z_]+", e))
    assert used, "no gradcomp metric found in the queries"
    missing = sorted(used - exported)
    assert not missing, f"queries name metrics nobody exports: {missing}"
    assert {"gradcomp_rejected_payloads_total", "gradcomp_bucket_seconds_bucket",
            "gradcomp_compression_ratio"} <= used


def _hook_text():
    """A DDP hook's metrics text, on a one-rank group of this process."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    try:
        return gt.HookState(gradcomp.Q4()).metrics_text()
    finally:
        dist.destroy_process_group()


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _free_port_pair():
    """A port p with p + 1 free as well (the ranks serve on port + rank); other tests run beside this one."""
    while True:
        p = _free_port()
        with socket.socket() as a, socket.socket() as b:
            try:
                a.bind(("127.0.0.1", p))
                b.bind(("127.0.0.1", p + 1))
            except OSError:
                continue
        return p


def _query(base, expr):
    url = f"{base}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    with urllib.request.urlopen(url, timeout=5) as r:
        body = json.load(r)
    assert body["status"] == "success", body
    return body["data"]["result"]


def _live_rules(path):
    """The rules with short windows and no `for`, so that they can fire within the test."""
    text = (MONITORING / "gradcomp.rules.yml").read_text()
    text = re.sub(r"\[(5|10|15)m\]", "[15s]", text)
    text = re.sub(r"for: \d+m", "for: 0s", text)
    path.write_text(text)


@contextlib.contextmanager
def _prometheus(tmp_path, job, targets):
    """A Prometheus server on 127.0.0.1 scraping `targets` every second as `job`, with the rules of
    _live_rules; yields its base URL."""
    port = _free_port()
    _live_rules(tmp_path / "rules.yml")
    listed = ", ".join(f'"{t}"' for t in targets)
    (tmp_path / "prometheus.yml").write_text(f"""
global: {{scrape_interval: 1s, evaluation_interval: 1s}}
rule_files: [rules.yml]
scrape_configs:
  - job_name: {job}
    static_configs:
      - targets: [{listed}]
""")
    server = subprocess.Popen([_tool("prometheus"), f"--config.file={tmp_path / 'prometheus.yml'}",
                               f"--storage.tsdb.path={tmp_path / 'tsdb'}", f"--web.listen-address=127.0.0.1:{port}",
                               "--log.level=warn"], stdout=subprocess.DEVNULL, stderr=open(tmp_path / "prom.log", "w"))
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.terminate()
        server.wait(timeout=30)


def _until_equal(base, job, expected, timeout=30):
    """Polls Prometheus until each metric's value per rank equals `expected[metric][rank]`; returns
    the mismatches left at the deadline."""
    deadline, mismatch = time.time() + timeout, None
    while time.time() < deadline:
        mismatch = []
        for metric, by_rank in expected.items():
            try:
                got = {int(s["metric"]["rank"]): float(s["value"][1])
                       for s in _query(base, f'{metric}{{job="{job}"}}')}
            except OSError:
                got = {}
            for r, want in by_rank.items():
                if got.get(r) != float(want):
                    mismatch.append((metric, r, got.get(r), want))
        if not mismatch:
            return []
        time.sleep(1)
    return mismatch


def test_prometheus_scrapes_a_real_ddp_run_equal_to_stats_and_fires_the_straggler_alert(tmp_path):
    metrics_port = _free_port_pair()
    control = tmp_path / "control"
    control.mkdir()
    with _prometheus(tmp_path, "train", [f"127.0.0.1:{metrics_port}", f"127.0.0.1:{metrics_port + 1}"]) as base:
        _straggler_run(tmp_path, base, metrics_port, control)


def _straggler_run(tmp_path, base, metrics_port, control):
    ranks = {}
    thread = threading.Thread(target=lambda: ranks.update(
        result=launch("workers_monitoring", "train_and_serve", 2, metrics_port, str(control), 1, 0.25,
                      timeout=300)))
    thread.start()
    try:
        # The alert for the rank everyone waits for, from the live series.
        fired, deadline = None, time.time() + 120
        while time.time() < deadline and not fired:
            time.sleep(1)
            try:
                fired = [a for a in _query(base, 'ALERTS{alertname="GradcompStragglerLate",alertstate="firing"}')]
            except OSError:
                continue
        assert fired, f"the straggler alert did not fire; prometheus log: {(tmp_path / 'prom.log').read_text()[-2000:]}"
        assert {a["metric"]["rank"] for a in fired} == {"1"}, fired
        (control / "stop").touch()
        while not all((control / f"stats.{r}.json").exists() for r in range(2)) and thread.is_alive():
            time.sleep(0.2)
        stats = {r: json.loads((control / f"stats.{r}.json").read_text()) for r in range(2)}
        # Once training stopped the counters stand still: the scraped values must reach them exactly.
        pairs = {"gradcomp_sent_bytes_total": "bytes_sent", "gradcomp_uncompressed_bytes_total": "uncompressed_bytes",
                 "gradcomp_buckets_total": "buckets", "gradcomp_steps_total": "steps",
                 "gradcomp_codec_seconds_total": "codec_seconds",
                 "gradcomp_communication_seconds_total": "comm_seconds",
                 "gradcomp_nonfinite_buckets_total": "nonfinite_buckets"}
        mismatch = _until_equal(base, "train", {m: {r: stats[r]["total"][k] for r in range(2)} for m, k in pairs.items()})
        assert not mismatch, mismatch
        assert stats[0]["total"]["steps"] == stats[0]["steps"]
        labels = _query(base, 'gradcomp_steps_total{job="train"}')[0]["metric"]
        assert labels["codec"] == "q4" and labels["front_end"] == "ddp" and labels["node"], labels
    finally:
        (control / "stop").touch()
        (control / "done").touch()
        thread.join(timeout=60)
    assert ranks.get("result") and all(s > 0 for s in ranks["result"]), ranks


def test_a_cpp_grad_sync_run_reaches_prometheus_through_node_exporters_textfile_collector(tmp_path):
    """The C++ trainer writes its metrics file every step (atomically); node_exporter's textfile
    collector serves the directory; Prometheus's values equal the trainer's final counters, and
    promtool's linter accepts the files."""
    metrics = tmp_path / "textfile"
    metrics.mkdir()
    run = launch_trainer(2, ["--data", digits_file(tmp_path), "--codec", "q4", "--steps", "30",
                             "--metrics-dir", metrics])
    for r in range(2):
        text = (metrics / f"gradcomp-rank{r}.prom").read_text()
        lint = subprocess.run([_tool("promtool"), "check", "metrics"], input=text, capture_output=True, text=True)
        assert lint.returncode == 0, lint.stdout + lint.stderr
        assert 'front_end="gradsync"' in text and 'codec="q4"' in text
    port = _free_port()
    exporter = subprocess.Popen([_tool("prometheus-node-exporter"), "--collector.disable-defaults",
                                 "--collector.textfile", f"--collector.textfile.directory={metrics}",
                                 f"--web.listen-address=127.0.0.1:{port}"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        with _prometheus(tmp_path, "gradsync", [f"127.0.0.1:{port}"]) as base:
            expected = {"gradcomp_sent_bytes_total": {r["rank"]: r["bytes_sent"] for r in run.ranks},
                        "gradcomp_uncompressed_bytes_total": {r["rank"]: r["uncompressed_bytes"] for r in run.ranks},
                        "gradcomp_steps_total": {r["rank"]: 30 for r in run.ranks}}
            mismatch = _until_equal(base, "gradsync", expected)
            assert not mismatch, mismatch
    finally:
        exporter.terminate()
        exporter.wait(timeout=30)


def test_the_python_metrics_pass_promtools_linter():
    text = _hook_text()
    lint = subprocess.run([_tool("promtool"), "check", "metrics"], input=text, capture_output=True, text=True)
    assert lint.returncode == 0, lint.stdout + lint.stderr
