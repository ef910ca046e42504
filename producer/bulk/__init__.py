"""Bulk jobs: a JSONL / OpenAI Batch / CSV / Parquet file through the queue into JSONL (or Parquet) results.

``run(INPUT, OUTPUT, ...)`` is resumable: re-running with the same OUTPUT finishes only what is
missing. Never imports torch, the engine or the worker.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tokenmill.producer.bulk.errors import BulkError, BulkInputError
from tokenmill.producer.bulk.options import BulkOptions
from tokenmill.producer.bulk.pipeline import BulkJob
from tokenmill.producer.bulk.report import BulkSummary
from tokenmill.producer.client import Producer
from tokenmill.producer.config import ProducerConfig


def run(input_path: str | Path, output_path: str | Path, *, producer: Producer | None = None,
        config: ProducerConfig | None = None, show_progress: bool = False, **options: Any) -> BulkSummary:
    """Generate a completion for every record of ``input_path`` into ``output_path``.

    Args:
        input_path: JSONL (``{"id", "prompt" | "messages", params...}``), OpenAI Batch request
            JSONL, CSV with a prompt column, or Parquet (needs the ``parquet`` extra).
        output_path: results JSONL (plain, or OpenAI Batch output lines for OpenAI input), or
            Parquet when named ``.parquet`` / ``.pq`` (plain lines; needs the ``parquet`` extra);
            failures and invalid records go to ``errors_path`` (default OUTPUT + ".errors.jsonl").
        producer: the queue to use; None builds one from ``config`` (and closes it afterwards).
        config: queue and Redis settings when no ``producer`` is given.
        show_progress: draw a progress bar on stderr.
        **options: fields of :class:`BulkOptions` (``format``, ``priority``, ``max_in_flight``,
            ``retries``, ``errors_path``, ``raw``, ``system``, ``cancel_on_interrupt``, ``retry_cancelled``,
            ``max_tokens``, ``temperature``, ...).

    Returns:
        Counts by status, tokens, wall time; ``is_interrupted`` after Ctrl-C (files stay valid).

    Raises:
        BulkInputError: the input cannot be read (missing, no prompt column, no pyarrow).
        BulkError: the output file is not a tokenmill bulk output, or a Parquet output cannot be
            written (no pyarrow, OpenAI Batch input); raised before anything is sent.
        pydantic.ValidationError: invalid options.
    """
    bulk_options = BulkOptions.model_validate(options)
    input_file, output_file = Path(input_path), Path(output_path)
    if not input_file.is_file():
        raise BulkInputError(f"input file {input_file} does not exist")
    owned = producer is None
    client = producer if producer is not None else Producer.from_config(config or ProducerConfig())
    try:
        return BulkJob(client, input_file, output_file, bulk_options, show_progress=show_progress).run()
    finally:
        if owned:
            client.close()


__all__ = ["BulkError", "BulkInputError", "BulkJob", "BulkOptions", "BulkSummary", "run"]
