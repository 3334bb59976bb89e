"""The errors a process of the run ends with when no restart can help, and the exit status that says so.

  EXIT_CONFIG_ERROR  78 (EX_CONFIG of sysexits.h): the exit status of a process that met a configuration error or
                     unrecoverable input; the failure policy (`trainingrun.failure_policy.classify`) fails the run at
                     once instead of restarting the group.
  ConfigError        the one configuration error of the package (a bad spec, environment, input file or checkpoint
                     set that no restart can fix); every program catches it and exits EXIT_CONFIG_ERROR. A ValueError,
                     so code that validates values may raise it where a ValueError is expected.
  StoreError         a store operation failed permanently; the message names the store URL and key. The store's
                     own errors (`trainingrun.store.base`) derive from it.
  CorruptPayload     a value read back from the store does not decode as its contract (a payload, a schedule, a
                     marker, a JSON record): damaged, or written by something else. Raised by the store's backends
                     and by the contract records read through it (`resume`, `progress`); exit 78.
"""

from __future__ import annotations

EXIT_CONFIG_ERROR = 78


class ConfigError(ValueError):
    """A configuration or input error no restart can fix: the process exits with EXIT_CONFIG_ERROR."""


class StoreError(RuntimeError):
    """A store operation failed permanently; the message names the store URL and key."""


class CorruptPayload(StoreError):
    """Stored bytes do not decode as the expected wire format (a payload, a schedule, a marker or a JSON value):
    damaged on disk or in memory, or written by something else. The message names the store and the key."""
