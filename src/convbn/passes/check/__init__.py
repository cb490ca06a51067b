"""Validation shared by both passes: one tolerance rule, one normalisation of ``example_inputs``, the whole-model step check, fold's sample inputs."""
