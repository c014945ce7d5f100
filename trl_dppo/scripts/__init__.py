"""The jobs this package ships, each a TRL-style script: `trl-dppo <command>` runs them (see `trl_dppo.cli`)."""
