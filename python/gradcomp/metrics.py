"""Prometheus metrics of gradcomp's hooks: ``gradcomp.torch.metrics.serve(port, hook)``.

The metric names, units and values come from the core (``gradcomp::prometheus_text``, the same text a
C++ ``GradSync`` program writes for node_exporter's textfile collector); this module hands them to
``prometheus_client``, either on a port of its own or in a registry the program already serves.
Nothing runs on the training step: values are read from the hooks' counters when Prometheus scrapes.
``docs/operations.md`` lists the metrics, the alert rules and the dashboard.
"""
from __future__ import annotations

import threading

__all__ = ["GradcompCollector", "serve", "register"]


def _metrics_text(hook) -> str:
    text = getattr(hook, "metrics_text", None)
    if text is None:
        raise TypeError("gradcomp metrics take hooks of gradcomp.torch.register, HookState, gradcomp.torch.fsdp or "
                        f"gradcomp.torch.diloco, got {type(hook).__name__}")
    return text()


class GradcompCollector:
    """A ``prometheus_client`` collector of one or more hooks of this process (their metrics carry
    ``front_end`` "ddp", "fsdp" or "diloco"; two hooks of one front end in one process must not share a codec)."""

    def __init__(self, *hooks):
        for h in hooks:
            _metrics_text(h)
        self._hooks = list(hooks)
        self._lock = threading.Lock()

    def add(self, hook) -> None:
        _metrics_text(hook)
        with self._lock:
            self._hooks.append(hook)

    def collect(self):
        from prometheus_client.parser import text_string_to_metric_families

        with self._lock:
            hooks = list(self._hooks)
        families = {}
        for hook in hooks:
            for family in text_string_to_metric_families(_metrics_text(hook)):
                if family.name in families:
                    families[family.name].samples.extend(family.samples)
                else:
                    families[family.name] = family
        yield from families.values()


def register(*hooks, registry=None) -> GradcompCollector:
    """Adds the hooks' metrics to ``registry`` (default: prometheus_client's global one, which
    ``prometheus_client.start_http_server`` and most web frameworks' exporters serve)."""
    from prometheus_client import REGISTRY

    collector = GradcompCollector(*hooks)
    (REGISTRY if registry is None else registry).register(collector)
    return collector


def serve(port: int, *hooks, addr: str = "127.0.0.1", per_rank_port: bool = True) -> GradcompCollector:
    """Serves the hooks' metrics over HTTP at ``addr:port`` (``/metrics``), on a registry of their own,
    from a daemon thread. The endpoint has no authentication, so it listens on loopback unless ``addr``
    says otherwise (``"0.0.0.0"``: every interface, for a scraper on another host; docs/operations.md
    says what it reveals). With ``per_rank_port`` (default) each process of a node listens on
    ``port + local rank`` (LOCAL_RANK or SLURM_LOCALID), so that the ranks of a node do not collide.
    Returns the collector; ``collector.add(hook)`` adds another hook later."""
    import os

    from prometheus_client import CollectorRegistry, start_http_server

    if per_rank_port:
        port += int(os.environ.get("LOCAL_RANK", os.environ.get("SLURM_LOCALID", "0")) or 0)
    registry = CollectorRegistry(auto_describe=True)
    collector = GradcompCollector(*hooks)
    registry.register(collector)
    start_http_server(port, addr=addr, registry=registry)
    return collector


