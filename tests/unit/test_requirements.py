"""What a worker checks before it launches a script: the installed versions against script.requirements."""

from importlib import metadata

from api_schemas.requirements import package_name, unmet


def test_installed_packages_that_satisfy_the_specifiers_are_met():
    torch_version = metadata.version("torch")
    assert unmet(["torch", f"torch=={torch_version}", "accelerate>=1", "numpy<99"]) == []


def test_a_missing_package_or_a_version_outside_the_specifier_is_named():
    assert unmet(["torch>=99", "surely-not-installed-pkg"]) == [
        f"torch {metadata.version('torch')} is installed, the script needs >=99",
        "surely-not-installed-pkg is not installed",
    ]


def test_names_compare_as_pypi_does():
    assert package_name("Safe_Tensors>=0.4") == package_name("safe-tensors") == "safe-tensors"
