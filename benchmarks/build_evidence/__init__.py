"""What a build proves, apart from what it measures: an image bound to its digest, wheels and SASS (image_proof),
a vLLM build's stages and kernels (vllm_build_report), a QEMU rehearsal stage by stage (rehearsal_report), and the
commit both are bound to (provenance). Their reports land in benchmarks/results/ beside the speed figures."""
