"""BucketBatches: TokenWindows → fixed-shape Batches, in Beam. The batching itself is the Packer's
(pipeline/stages/packer.py); this keeps a Packer's state in Beam state per key and flushes it at the end of
input, so the pipeline and ``batch_windows`` (the benchmarks) make the same batches.

Padding keys windows by (bucket, shard): a bucket's batches fill apart from the others', spread over
shards. What each key holds at the end goes, per shard, through one GroupByKey to a Packer that fills it
across buckets. Packing needs windows of every length together, so it keys by shard alone and the end of
input is flushed per key directly.
"""

from __future__ import annotations

import apache_beam as beam
from apache_beam import coders
from apache_beam.transforms import userstate

from docbeam.config import BatchingConfig
from docbeam.pipeline.records import TokenWindow
from docbeam.pipeline.stages.packer import Packer, bucket_for, check_packing, window_shard


class _DriveThePacker(beam.DoFn):
    """Resumes the key's Packer from state for each window, and stores what it holds afterwards.

    Needed instead of GroupIntoBatches since that one's processing-time timer (declared even when unused)
    sends a pipeline off the DirectRunner's FnApiRunner onto its single-threaded BundleBasedDirectRunner,
    which ignores ``direct_num_workers``. At the end of the window (for a batch job, the end of input) a
    packing key flushes its Packer; a padding key sends what it holds on ``HELD`` as (shard, window), to
    be filled across buckets with its shard's other keys.
    """

    HELD = "held"

    HELD_STATE = userstate.BagStateSpec("held", coders.PickleCoder())
    GATHERED_STATE = userstate.ReadModifyWriteStateSpec("gathered", coders.PickleCoder())
    END = userstate.TimerSpec("end", userstate.TimeDomain.WATERMARK)

    def __init__(self, config: BatchingConfig):
        self._config = config
        self._packing = check_packing(config)

    def process(
        self,
        element,
        window=beam.DoFn.WindowParam,
        held=beam.DoFn.StateParam(HELD_STATE),
        gathered=beam.DoFn.StateParam(GATHERED_STATE),
        end=beam.DoFn.TimerParam(END),
    ):
        _, token_window = element
        end.set(window.max_timestamp())
        packer = Packer(self._config, held=held.read(), gathered=gathered.read())
        batches = packer.add(token_window)
        if batches:  # windows leave ``held`` only in batches: otherwise it just grew by this window
            held.clear()
            for w in packer.held:
                held.add(w)
        else:
            held.add(token_window)
        gathered.write(dict(packer.gathered))
        yield from batches

    @userstate.on_timer(END)
    def end(self, held=beam.DoFn.StateParam(HELD_STATE), gathered=beam.DoFn.StateParam(GATHERED_STATE)):
        windows = list(held.read())
        held.clear()
        gathered.clear()
        if self._packing:
            yield from Packer(self._config, held=windows).flush()
        else:
            for w in windows:
                yield beam.pvalue.TaggedOutput(self.HELD, (window_shard(w, self._config), w))


class BucketBatches(beam.PTransform):
    """``config.packing`` comes resolved from the job's plan (``JobPlan.batching()``): true or false, never
    ``auto``."""

    def __init__(self, config: BatchingConfig):
        super().__init__()
        self._config = config
        self._packing = check_packing(config)

    def expand(self, windows):
        cfg, packing = self._config, self._packing
        if packing:
            keyed = windows | "KeyByShard" >> beam.Map(lambda w: (window_shard(w, cfg), w)).with_output_types(
                tuple[int, TokenWindow]
            )  # a deterministic key coder for state
        else:
            keyed = windows | "KeyByBucketAndShard" >> beam.Map(
                lambda w: ((bucket_for(w.length, cfg.buckets), window_shard(w, cfg)), w)
            ).with_output_types(tuple[tuple[int, int], TokenWindow])
        batched = keyed | "Batch" >> beam.ParDo(_DriveThePacker(cfg)).with_outputs(_DriveThePacker.HELD, main="full")
        if packing:
            return batched.full | "SpreadBatches" >> beam.Reshuffle()
        filled = (
            batched[_DriveThePacker.HELD]
            | "HeldByShard" >> beam.GroupByKey()
            | "FillAcrossBuckets"
            >> beam.FlatMap(lambda shard_windows: Packer(cfg, held=list(shard_windows[1])).flush())
        )
        return (batched.full, filled) | "AllBatches" >> beam.Flatten() | "SpreadBatches" >> beam.Reshuffle()
