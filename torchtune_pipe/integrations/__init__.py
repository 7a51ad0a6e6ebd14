"""Integrations with training frameworks: :class:`~.lightning.TuningCallback` for Lightning.

The modules here import their framework on import; ``torchtune_pipe`` itself never needs one.
"""
