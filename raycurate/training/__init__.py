"""The torch/DeepSpeed training machinery shared by the SFT and BDS stages (no Ray).

Layering: ``stages -> training -> algorithms -> models/data`` (``config`` anywhere).  The stages own the Ray parts
(the Ray Train session, ``TorchTrainer`` launches, the worker entry points); this package holds what a training
worker does inside a process group, so it is testable in-process with a session double:

* :mod:`~raycurate.training.order` -- data order, step counts, the LR schedule and the checkpoint cadence.
* :mod:`~raycurate.training.batches` -- the token table, ``collate`` and the default SFT loss.
* :mod:`~raycurate.training.deepspeed_config` -- the DeepSpeed config dict and the batch arithmetic.
* :mod:`~raycurate.training.engines` -- ``DDPEngine`` / ``DeepSpeedEngine``, optimizer, schedule, model loading.
* :mod:`~raycurate.training.zero_checkpoint` -- ZeRO universal conversion, consolidation and the DeepSpeed 0.19
  repairs (with the upgrade path).
* :mod:`~raycurate.training.checkpoint` -- ``TrainState`` and the ONE checkpoint writer/reader of both loops.
* :mod:`~raycurate.training.protocol` -- the ``TrainSession`` protocol every module above takes (below them all).
* :mod:`~raycurate.training.session` -- resume, worker set-up, fault injection.
* :mod:`~raycurate.training.collectives` -- sums and gathers over the worker process group.
* :mod:`~raycurate.training.export` -- the final HF export and the run metrics.
* :mod:`~raycurate.training.bds_state` / :mod:`~raycurate.training.bds_online` -- BDS's data logits (omega) and
  online BMO responses, with their checkpoint files.

Importing this package imports nothing heavy; every module imports torch/DeepSpeed inside its functions.
"""
