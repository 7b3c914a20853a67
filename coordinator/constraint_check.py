"""Checks a request's constraint before it takes a session: compiled off the event loop, within the time limit."""

from __future__ import annotations

import asyncio

from specdec.sampling.constraints import ConstraintCompiler, ConstraintSpec


class ConstraintCheck:
    """Compiles constraints with the target's tokenizer (cached across requests, as the replicas cache them): an
    invalid one, or one that takes longer than --max-constraint-compile-s, is INVALID_ARGUMENT naming its field."""

    def __init__(self, compiler: ConstraintCompiler):
        self.compiler = compiler

    async def check(self, spec: ConstraintSpec) -> None:
        compile_s = self.compiler.limits.max_compile_s
        try:
            await asyncio.wait_for(asyncio.to_thread(self.compiler.compile, spec), compile_s)
        except TimeoutError:  # the compile runs on in its thread; its result is cached, and the spec refused
            self.compiler.refuse_slow(spec)
