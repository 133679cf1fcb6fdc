"""The backend contract, named data, trust, a delegate on its backend, LoweredBackendModule and call_delegate.

Bottom to top: ``specs`` (CompileSpec, DelegationSpec), ``named_data`` (NamedDataStore, NamedDataMap),
``preprocess_result`` (PreprocessResult) and ``preprocess_checks`` (a result checked), ``compile_units``
(partitions compiled as units), ``backend_details`` (BackendDetails, the registry; it re-exports
``preprocess_result``'s names), ``trust`` (which backends may run native code),
``instance`` (a delegate's blob on its backend at run time), ``lowered_module`` (LoweredBackendModule
and its call in a graph).
"""

from typing import Any


def __getattr__(name: str) -> Any:
    # ``torchdelegate.delegate`` was the module ``instance`` is now: its name still finds it, with a warning
    if name == "DelegateInstance":
        import warnings

        from torchdelegate.delegate.instance import DelegateInstance

        warnings.warn(
            "torchdelegate.delegate.DelegateInstance moved to torchdelegate.delegate.instance; import from there "
            "(the old name goes in the next release)",
            DeprecationWarning,
            stacklevel=2,
        )
        return DelegateInstance
    raise AttributeError(f"module 'torchdelegate.delegate' has no attribute {name!r}")
