"""Prometheus export of flashport.stats() (optional extra: `pip install flashport[prometheus]`).

    from flashport import prometheus
    prometheus.register()                 # into prometheus_client's default registry
    prometheus_client.start_http_server(9100)

Every counter of stats() becomes `flashport_<counter>_total{backend="..."}`, peak_extra_bytes a gauge,
and the guard's error distribution the histogram `flashport_guard_error_ratio{backend="..."}` (max |error|
/ tolerance per check; > 1 failed), and rewrites() the counter `flashport_builtin_rewrites_total{rule="..."}`.
Values are read at each scrape.
"""
from __future__ import annotations

from . import monitor

try:
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
except ImportError as e:  # pragma: no cover - the extra is not installed
    raise ImportError("flashport.prometheus needs prometheus-client: pip install 'flashport[prometheus]'") from e

_HELP = {"calls": "public calls whose forward this backend served", "forward": "forward passes",
         "backward": "backward passes", "errors": "exceptions raised", "fallbacks": "calls served as a fallback "
         "(first choice quarantined, or no fast GPU backend)", "guard_checks": "calls the guard re-checked",
         "guard_failures": "guard checks over the tolerance", "guard_skipped": "sampled calls the guard "
         "could not check", "flops": "floating-point operations (FlashAttention's convention)",
         "bytes_read": "bytes of q, k, v read"}


class StatsCollector:
    def collect(self):
        stats = monitor.stats()
        for name, help_ in _HELP.items():
            fam = CounterMetricFamily(f"flashport_{name}", help_, labels=["backend"])
            for backend, row in stats.items():
                fam.add_metric([backend], row[name])
            yield fam
        peak = GaugeMetricFamily("flashport_peak_extra_bytes", "largest working memory of one call beyond its "
                                 "inputs (the backend's own account)", labels=["backend"])
        hist = HistogramMetricFamily("flashport_guard_error_ratio", "guard checks by max |error| / tolerance",
                                     labels=["backend"])
        for backend, row in stats.items():
            peak.add_metric([backend], row["peak_extra_bytes"])
            if "guard_error_hist" in row:
                edges, counts = row["guard_error_hist"]["edges"], row["guard_error_hist"]["counts"]
                buckets, total = [], 0
                for edge, n in zip(edges[1:], counts):
                    total += n
                    buckets.append(("+Inf" if edge == float("inf") else repr(edge), total))
                hist.add_metric([backend], buckets, sum_value=row["guard_error_ratio_sum"])
        yield peak
        yield hist
        rewritten = CounterMetricFamily("flashport_builtin_rewrites", "programmable calls backend=None ran as the "
                                        "built-in call they equal", labels=["rule"])
        for rule, n in monitor.rewrites().items():
            rewritten.add_metric([rule], n)
        yield rewritten


_registered: list = []


def register(registry=None) -> StatsCollector:
    """Add the collector to `registry` (default: prometheus_client's REGISTRY), once per registry."""
    from prometheus_client import REGISTRY
    registry = REGISTRY if registry is None else registry
    for reg, col in _registered:
        if reg is registry:
            return col
    col = StatsCollector()
    registry.register(col)
    _registered.append((registry, col))
    return col
