"""The command-line tools: ``torchtune-pipe`` (report, watch, demo)."""
