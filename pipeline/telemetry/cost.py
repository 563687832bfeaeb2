"""What a run cost: its workers' hours at a price per worker hour, per million tokens and per million documents.

The price is ``runner.price_per_hour`` (USD per worker hour) where the config sets it; on Dataflow, for a machine type
in ``PRICES``, docbeam's dated table of list prices; otherwise none, and the summary says how to set one. The hours are
the run's wall time times the VMs that ran its batches (the timing records name each batch's host): a VM that joined
late or left early is counted for the whole run, and one that ran no batch is not counted. What it leaves out is said
in every cost section (``LEAVES_OUT``).
"""

from __future__ import annotations

import dataclasses

LEAVES_OUT = (
    "storage and network charges, the driver or launcher machine, Dataflow Shuffle and worker disks, "
    "committed-use or spot discounts, and VMs that ran no batch"
)


@dataclasses.dataclass(frozen=True)
class Price:
    """One machine type's list price per worker hour on Dataflow, how it is made up, and where it was read."""

    usd_per_hour: float
    made_of: str
    as_of: str
    sources: tuple[str, ...]


# Dataflow batch: vCPU $0.056/h and memory $0.003557/GB-h (us-central1); GPUs and TPUs at their Compute Engine /
# Cloud TPU on-demand rates. Read from secondary sources (the pages below), not Google's price pages themselves:
# check the live pages (https://cloud.google.com/dataflow/pricing, https://cloud.google.com/tpu/pricing) and set
# runner.price_per_hour where they differ or a discount applies.
_DATAFLOW_RATES = "https://github.com/GoogleCloudPlatform/dataflow-metrics-exporter/blob/1b1a22e/README.md"
_GCE_CATALOG = "https://github.com/Cyclenerd/google-cloud-pricing-cost-calculator/blob/fd66b26/pricing.yml"
_TPU_CATALOG = "https://github.com/skypilot-org/skypilot-catalog/blob/017e250/catalogs/v7/gcp/vms.csv"
_VCPU, _GB = 0.056, 0.003557
_L4 = 0.56004  # per GPU hour, us-central1 on-demand (Compute Engine)


def _dataflow(vcpus: int, gb: int, extra: float = 0.0) -> float:
    return round(vcpus * _VCPU + gb * _GB + extra, 4)


PRICES: dict[str, Price] = {
    "n2-standard-8": Price(
        _dataflow(8, 32), "8 vCPU x $0.056 + 32 GB x $0.003557 (Dataflow batch)", "2023-09", (_DATAFLOW_RATES,)
    ),
    "g2-standard-4": Price(
        _dataflow(4, 16, _L4),
        "4 vCPU + 16 GB at Dataflow batch rates + 1 NVIDIA L4 x $0.56004",
        "2026-07",
        (_DATAFLOW_RATES, _TPU_CATALOG),
    ),
    "g2-standard-24": Price(
        _dataflow(24, 96, 2 * _L4),
        "24 vCPU + 96 GB at Dataflow batch rates + 2 NVIDIA L4 x $0.56004",
        "2026-07",
        (_DATAFLOW_RATES, _TPU_CATALOG),
    ),
    # Dataflow bills TPU workers per chip hour (https://cloud.google.com/dataflow/docs/tpu/tpu-support).
    "ct5lp-hightpu-1t": Price(1.20, "1 TPU v5e chip x $1.20", "2026-07", (_TPU_CATALOG,)),
    "ct5lp-hightpu-4t": Price(4.80, "4 TPU v5e chips x $1.20", "2026-07", (_TPU_CATALOG,)),
    "ct5lp-hightpu-8t": Price(9.60, "8 TPU v5e chips x $1.20", "2026-07", (_TPU_CATALOG,)),
    "ct6e-standard-1t": Price(2.70, "1 TPU v6e chip x $2.70", "2026-07", (_TPU_CATALOG,)),
}
# Not a price: what the n2 figure is next to on Compute Engine, for a reader comparing (GCE on-demand, us-central1).
GCE_N2_STANDARD_8 = (0.388472, _GCE_CATALOG)


def worker_price(price_per_hour: float | None, runner: str, machine_type: str | None) -> tuple[float | None, str]:
    """(USD per worker hour or None, where it comes from)."""
    if price_per_hour is not None:
        return price_per_hour, "runner.price_per_hour"
    if "dataflow" in runner.lower() and machine_type in PRICES:
        p = PRICES[machine_type]
        return p.usd_per_hour, (
            f"docbeam's table (pipeline/telemetry/cost.py): {machine_type} on Dataflow, {p.made_of}, list prices "
            f"as of {p.as_of} ({', '.join(p.sources)}); set runner.price_per_hour to override"
        )
    where = f"machine type {machine_type!r}" if machine_type else f"runner {runner}"
    return None, f"no price for {where}: set runner.price_per_hour (USD per worker hour) to have one"


def cost_section(
    usd_per_hour: float | None, source: str, wall_seconds: float, vms: int, tokens: int, documents: int
) -> dict:
    """summary.json's ``cost``: every figure computed from the fields beside it, so they add up."""
    workers = max(vms, 1)
    hours = round(wall_seconds / 3600 * workers, 6)
    # From the rounded hours and unrounded after: each figure is its fields' product or quotient exactly.
    usd = None if usd_per_hour is None else usd_per_hour * hours
    return {
        "usd": usd,
        "usd_per_million_tokens": None if usd is None or not tokens else usd / tokens * 1e6,
        "usd_per_million_documents": None if usd is None or not documents else usd / documents * 1e6,
        "price_per_hour": usd_per_hour,
        "hours": hours,
        "workers": workers,
        "wall_seconds": round(wall_seconds, 3),
        "tokens": tokens,
        "documents": documents,
        "source": source,
        "hours_from": f"wall time x {workers} VM{'s' if workers > 1 else ''} that ran batches (timing records)",
        "leaves_out": LEAVES_OUT,
    }


def describe(cost: dict) -> str:
    """The CLI's and the report's line."""
    if not isinstance(cost, dict):
        return "unknown"
    hours = f"{cost.get('hours', 0):.4f} worker hours"
    if cost.get("usd") is None:
        return f"{hours}; {cost.get('source', 'no price')}"
    per_tokens = cost.get("usd_per_million_tokens")
    return (
        f"${cost['usd']:.4f} ({hours} x ${cost['price_per_hour']}/h"
        + (f"; ${per_tokens:.4f} per million tokens" if per_tokens is not None else "")
        + "); leaves out storage, network, the driver"
    )
