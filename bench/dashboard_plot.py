"""The dashboard's first panels, fed by a real run, drawn with matplotlib (Grafana is not installable
here): 2 Gloo ranks train with the q4 hook serving metrics, rank 1 slowed by SLOW seconds a step after
the first third of the run, Prometheus scrapes every second; the panels' queries are read back
through Prometheus's range API.

    python bench/dashboard_plot.py --seconds 90 --out docs/img/dashboard-2026-12-04.png
"""
import argparse
import json
import pathlib
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import urllib.request

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "python"))


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def query_range(base, expr, start, end):
    url = f"{base}/api/v1/query_range?" + urllib.parse.urlencode(
        {"query": expr, "start": start, "end": end, "step": 1})
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.load(r)["data"]["result"]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=90)
    ap.add_argument("--slow", type=float, default=0.15)
    ap.add_argument("--out", default="dashboard.png")
    a = ap.parse_args()
    from launcher import launch

    with tempfile.TemporaryDirectory() as tmp:
        tmp = pathlib.Path(tmp)
        mport, pport = free_port(), free_port()
        (tmp / "prometheus.yml").write_text(f"""
global: {{scrape_interval: 1s, evaluation_interval: 1s}}
scrape_configs:
  - job_name: train
    static_configs:
      - targets: ["127.0.0.1:{mport}", "127.0.0.1:{mport + 1}"]
""")
        server = subprocess.Popen([shutil.which("prometheus"), f"--config.file={tmp / 'prometheus.yml'}",
                                   f"--storage.tsdb.path={tmp / 'tsdb'}", f"--web.listen-address=127.0.0.1:{pport}",
                                   "--log.level=warn"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        control = tmp / "control"
        control.mkdir()
        start = time.time()
        runner = threading.Thread(target=launch, args=("workers_monitoring", "train_and_serve", 2, mport,
                                                       str(control), 1, a.slow, a.seconds / 3),
                                  kwargs={"timeout": a.seconds + 200})
        runner.start()
        time.sleep(a.seconds)
        (control / "stop").touch()
        time.sleep(3)
        (control / "done").touch()
        runner.join()
        end = time.time()
        base = f"http://127.0.0.1:{pport}"
        panels = json.loads((ROOT / "monitoring" / "grafana-dashboard.json").read_text())["panels"]
        chosen = [p for p in panels if p["id"] in (1, 3, 4, 6)]
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(2, 2, figsize=(13, 7))
        for ax, panel in zip(axes.flat, chosen):
            for target in panel["targets"]:
                expr = target["expr"].replace('{job=~"$job"}', '{job="train"}').replace("$__rate_interval", "10s")
                for series in query_range(base, expr, start, end):
                    t, v = zip(*[(float(x) - start, float(y)) for x, y in series["values"]])
                    label = target["legendFormat"]
                    for k, val in series["metric"].items():
                        label = label.replace("{{" + k + "}}", val)
                    ax.plot(t, v, label=label)
            ax.set_title(panel["title"], fontsize=10)
            ax.set_xlabel("seconds")
            ax.legend(fontsize=7)
        fig.suptitle(f"gradcomp dashboard panels, 2 ranks on this machine; rank 1 slowed by {a.slow:g} s/step "
                     f"after {a.seconds / 3:.0f} s ({time.strftime('%Y-%m-%d', time.gmtime())})")
        fig.tight_layout()
        fig.savefig(a.out, dpi=100)
        server.terminate()
        server.wait(timeout=30)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
