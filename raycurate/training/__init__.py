"""The torch/DeepSpeed training machinery of the SFT and BDS stages (no Ray; importing it imports nothing heavy).

Loops: ``bds_loop`` and ``bds_step`` (BDS; SFT's loop is :mod:`raycurate.stages.train`), with ``bookkeeping``
(per-step records and cadence), ``checkpoint``, ``session`` (resume) and ``export``.  Pieces: ``order`` (data
order), ``batches``, ``engines``, ``deepspeed_config``, ``zero_checkpoint``, ``collectives``, ``protocol``
(``TrainSession``), ``bds_state`` / ``bds_online`` (omega, online responses), ``less_warmup`` (LESS's model work).
The map and the layering: docs/design.md, "Layers".
"""
