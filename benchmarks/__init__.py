"""Speed measurements and the evidence of what a build proves, each run one way: `python -m benchmarks.NAME`
(build evidence: `python -m benchmarks.build_evidence.NAME`). Their shared plumbing is benchmarks/harness/."""
