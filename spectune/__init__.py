"""The `spectune` console script's front door (`spectune.cli`)."""
