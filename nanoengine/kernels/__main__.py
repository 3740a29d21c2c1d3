"""`python -m nanoengine.kernels`: build the CPU kernels now (make assets runs this)."""

from nanoengine.kernels import cpu

why = cpu.unavailable_reason()
print("nanoengine CPU kernels: " + (f"ready in {cpu.build_dir()}" if why is None else f"not built ({why})"))
