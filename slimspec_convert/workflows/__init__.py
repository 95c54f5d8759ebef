"""Workflows: paths in, a report out (torchtune's recipes). Each composes the layers below and may use
``finetune``; only the CLI sits above.

``convert`` (ConvertConfig, convert), ``calibrate`` (calibrate_from_files), ``generate``
(generate_from_paths), ``trim`` (TrimConfig, trim_checkpoint), ``rank_sweep`` (RankSweepConfig,
rank_sweep), ``bench`` (bench_e2e, head_shapes). Import them from their modules: this ``__init__``
stays empty so that importing one workflow does not load the others (``rank_sweep`` loads the trainer).
"""
