"""Stateful engines the strategies, plugins and callbacks drive; :mod:`lightning_bigtrain.functional` keeps the
stateless functions they compute with.

* :class:`~lightning_bigtrain.engines.flat_shard.FlatShardedOptimizer`: ZeRO-1/2 flat partitions.
* :class:`~lightning_bigtrain.engines.compression.GradientCompression`: compressed gradient exchange.
* :class:`~lightning_bigtrain.engines.compensated.CompensatedStep`: compensated bf16 optimizer steps.
* :class:`~lightning_bigtrain.engines.logit_cache.LogitCache`: the teacher-logit cache of distillation.
"""
