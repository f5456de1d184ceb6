"""The RDMA backend of the bulk transport (pyverbs): capability probe; READ paths follow."""

from __future__ import annotations

__all__ = ["probe"]


def probe() -> tuple[bool, str]:
    """Whether an RDMA device is usable here, found by trying; ``(ok, reason or device name)``."""
    try:
        import pyverbs.device as verbs_device  # type: ignore[import-not-found]
    except ImportError as exc:
        return False, f"pyverbs is not installed ({exc}); install the 'rdma' extra and rdma-core"
    try:
        devices = verbs_device.get_device_list()
    except Exception as exc:  # pyverbs raises PyverbsRDMAError when no driver/device
        return False, f"pyverbs.device.get_device_list() failed: {exc}"
    if not devices:
        return False, "no RDMA device (pyverbs.device.get_device_list() is empty)"
    name = devices[0].name.decode() if isinstance(devices[0].name, bytes) else str(devices[0].name)
    try:
        from pyverbs.device import Context  # type: ignore[import-not-found]

        with Context(name=name):
            pass
    except Exception as exc:
        return False, f"cannot open a verbs context on RDMA device {name!r}: {exc}"
    return True, name
