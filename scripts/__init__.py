"""Development tools of this repository (not shipped in the wheel): the local federation launcher."""
