"""Example scripts, a package so that they import each other plainly: run them from the repository root with
`python -m examples.<name>`."""
