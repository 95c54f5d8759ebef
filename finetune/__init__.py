"""The recovery fine-tune and drafter training: ``run.finetune`` and ``run.train_drafter`` (the CLI calls
these), their config (``config.FinetuneConfig``) and the loop (``train``). Uses slimspec_convert's library,
never its CLI or workflows."""
