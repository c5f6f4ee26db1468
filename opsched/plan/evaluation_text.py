"""The text ``opsched evaluate`` prints for one parallel layout: step time, throughput, MFU, peak memory against
the limit, and where the step's time goes.

The figures are :func:`opsched.plan.layouts.evaluate_layout`'s; this module only words them.
"""

from __future__ import annotations


def summary_text(model: str, cluster, result, training) -> str:
    """The readable summary of one evaluated layout (``result``) of ``model`` on ``cluster``."""
    from opsched.units import bytes_text, plain, plural, seconds_text

    fit = "fits" if result.fits else "DOES NOT FIT"
    lines = [
        f"{model} on {cluster.devices} x {cluster.name}, layout {result.layout}, schedule {result.schedule_name}, "
        f"{plural(result.microbatches, 'microbatch', 'microbatches')} per pipeline, global batch {result.global_batch}",
        f"  step time {seconds_text(result.step_time)}, {result.tokens_per_second_per_device:,.0f} tokens/s per device, "
        f"MFU {100 * result.mfu:.1f} %",
        f"  peak memory {bytes_text(result.peak_memory_bytes)} per device of {bytes_text(result.memory_limit)}: {fit} "
        f"(Adam's state in {training.optimizer_state}, {plain(training.bytes_per_param)} bytes per parameter held)",
        "  where the time goes:",
    ]
    for key, seconds in result.breakdown.items():
        lines.append(f"    {key.replace('_', ' ')}: {seconds_text(seconds)}")
    return "\n".join(lines)
