"""The platform policy's reading of the CPU (jaxinfer/platform.py): feature flags from /proc/cpuinfo text as Linux
writes it on x86 and Arm, and whether they give bf16 products of their own."""

from jaxinfer import platform

X86_ZEN3 = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC 7B13
flags\t\t: fpu vme de pse tsc msr fma avx avx2 bmi2 sha_ni
"""
X86_ZEN4 = X86_ZEN3.replace("sha_ni", "sha_ni avx512f avx512_bf16 avx512_vnni")
X86_SAPPHIRE_RAPIDS = X86_ZEN3.replace("sha_ni", "avx512f amx_bf16 amx_tile amx_int8")
ARM_NEOVERSE_V1 = """processor\t: 0
BogoMIPS\t: 2100.00
Features\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm bf16 i8mm
"""


def test_cpu_flags_from_cpuinfo():
    assert {"avx2", "fma", "sha_ni"} <= platform.cpu_flags(X86_ZEN3)
    assert "bf16" in platform.cpu_flags(ARM_NEOVERSE_V1)
    assert platform.cpu_flags("processor\t: 0\n") == frozenset()


def test_native_bf16_flags():
    native = [platform.native_bf16(t) for t in (X86_ZEN3, X86_ZEN4, X86_SAPPHIRE_RAPIDS, ARM_NEOVERSE_V1)]
    assert native == [False, True, True, True]
    assert platform.Platform("gpu").native_bf16
