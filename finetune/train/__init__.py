"""Optimisation: the KL losses (``loss``), the trainer loop (``trainer``) and a new drafter's
initialisation (``init``)."""
