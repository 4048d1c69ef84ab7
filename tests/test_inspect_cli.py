"""`build.py inspect`: JSON for scripts, a table for people, exit status covered / not / could not tell."""
import json

from g5g.cli import main


def test_json_and_exit_codes(registry_images, capsys):
    assert main(["inspect", registry_images["oci_index"].ref, "--json", "--backend", "http"]) == 1
    out = json.loads(capsys.readouterr().out)
    assert out["image"] == registry_images["oci_index"].ref and out["digest"] == registry_images["oci_index"].digest
    assert out["platforms"]["linux/arm64"]["covered"] is False
    assert out["platforms"]["linux/amd64"]["source"] == "env:TORCH_CUDA_ARCH_LIST"

    assert main(["inspect", registry_images["ours"].ref, "--json", "--backend", "http"]) == 0
    assert main(["inspect", registry_images["torch_base"].ref, "--json", "--backend", "http"]) == 3
    capsys.readouterr()
    # several images: a list, and the worst answer wins
    assert main(["inspect", registry_images["ours"].ref, registry_images["torch_base"].ref, "--json",
                 "--backend", "http"]) == 3
    assert [r["image"] for r in json.loads(capsys.readouterr().out)] == [
        registry_images["ours"].ref, registry_images["torch_base"].ref]


def test_platform_and_arch_flags(registry_images, capsys):
    ref = registry_images["oci_index"].ref
    assert main(["inspect", ref, "--platform", "linux/amd64", "--json", "--backend", "http"]) == 0
    assert main(["inspect", ref, "--arch", "8.0", "--json", "--backend", "http"]) == 0


def test_table_for_people(registry_images, capsys):
    assert main(["inspect", registry_images["oci_index"].ref, "--backend", "http"]) == 1
    out = capsys.readouterr().out
    assert "linux/arm64" in out and "8.0 8.7 8.9 9.0 10.0 11.0 12.0" in out and registry_images["oci_index"].digest in out
    assert main(["inspect", registry_images["torch_base"].ref, "--backend", "http"]) == 3
    assert "--probe" in capsys.readouterr().out


def test_errors_are_one_line_and_exit_2(registry, registry_images, capsys):
    assert main(["inspect", f"{registry.host}/vllm/vllm-openai:nope", "--backend", "http"]) == 2
    err = " ".join(capsys.readouterr().err.split())  # g5g.cli's rich console wraps at the terminal width
    assert err == (f"error: {registry.host}/vllm/vllm-openai:nope: tag 'nope' not found in "
                   f"{registry.host}/vllm/vllm-openai (404 MANIFEST_UNKNOWN)")
    assert main(["inspect", registry_images["ours"].ref, "--arch", "turing7"]) == 2
    assert "--arch 'turing7' is not a CUDA compute capability" in capsys.readouterr().err
