"""Diagnostic (figure 1): the connector's writer threads without their per-file facts.

With this directory first on PYTHONPATH, every Python process of a run (vLLM's engine process included)
gets `eagle3data.contracts.measuring.written_facts` replaced, as that module is imported, by one that returns
`[]`: no CRC copies, no `slot_facts`, so none of their hold on Python's lock beside vLLM's engine
thread. The files then carry no facts (validate would measure them from their bytes); figure 1 validates
nothing, so its ratio says what the facts cost there:

    EXTRA_PYTHONPATH=$PWD/scripts/gpu/no_facts bash scripts/gpu/run.sh bench
"""

import importlib.abc
import importlib.util
import os
import sys

TARGET = "eagle3data.contracts.measuring"


class _PatchAfterImport(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path=None, target=None):
        if name != TARGET:
            return None
        sys.meta_path.remove(self)  # find the real module, then stand aside
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None:
            return None
        self._real = spec.loader
        spec.loader = self
        return spec

    def create_module(self, spec):
        return self._real.create_module(spec)

    def exec_module(self, module):
        self._real.exec_module(module)
        module.written_facts = lambda states, norms, low: "[]"
        print(f"no_facts diagnostic: {TARGET}.written_facts returns no facts in pid {os.getpid()}",
              file=sys.stderr, flush=True)


sys.meta_path.insert(0, _PatchAfterImport())
