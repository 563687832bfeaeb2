"""Beam's graph building, made cheaper for the test process only: three answers Beam recomputes hundreds of times
per pipeline, remembered where they cannot change, one debugging aid left out, and a cheaper compression level.

The suite builds over a hundred small pipelines, and on the 2-core machine Beam spends more CPU building and
translating each graph than the tiny model spends encoding it. Nothing here changes what a pipeline computes:
each memo keys on the object whose answer it holds, and anything it cannot key safely is asked as Beam asks.
`docbeam run` itself runs Beam unpatched, and so do the tests' child processes."""

from __future__ import annotations

import types
import weakref


def per_function(ask):
    """``ask(func)``, remembered per plain function; a bound method's answer is kept under its function (the
    answers below depend on the function's code, defaults and annotations alone, fixed once it exists, and
    are immutable). Builtins, partials and callable objects are asked each time."""
    plain, bound = weakref.WeakKeyDictionary(), weakref.WeakKeyDictionary()

    def remembered(func):
        if type(func) is types.FunctionType:
            answers, key = plain, func
        elif type(func) is types.MethodType and type(func.__func__) is types.FunctionType:
            answers, key = bound, func.__func__
        else:
            return ask(func)
        try:
            return answers[key]
        except KeyError:
            answer = answers[key] = ask(func)
            return answer

    remembered.memoized = True
    return remembered


def memoize_signatures() -> None:
    """``typehints.decorators.get_signature`` and ParDo's look at the source of ``process``, once per function.

    Beam 2.77 asks for a signature ~8,000 times while it builds and starts one pipeline of this job (every DoFn
    method, again per ParDo, per bundle, per state-spec check), and reads the source file of every ``process``
    it wraps to warn of a yield beside a return: about 1.3 s of CPU per pipeline together."""
    from apache_beam.transforms import core, ptransform, util
    from apache_beam.typehints import decorators

    if getattr(decorators.get_signature, "memoized", False):
        return
    get_signature = per_function(decorators.get_signature)
    for module in (decorators, core, ptransform, util):
        module.get_signature = get_signature
    core._check_fn_use_yield_and_return = per_function(core._check_fn_use_yield_and_return)


def memoize_dofn_specs() -> None:
    """Beam's ``userstate.get_dofn_specs``, remembered per DoFn object for this test process.

    Needed since Beam 2.77 asks it about every DoFn of a pipeline some seven times (building the graph,
    translating it, starting each bundle), and each answer inspects the signature of every method of the DoFn,
    ~30 of them: a second of CPU per whole pipeline on the 2-core machine, and the suite builds about a
    hundred. The answer depends only on the DoFn's methods, which do not change once it exists; each caller
    gets its own copies of the sets. A DoFn that cannot be remembered (unhashable, no weak reference) is
    asked each time, as Beam does."""
    from apache_beam.transforms import userstate

    ask = userstate.get_dofn_specs
    if getattr(ask, "memoized", False):
        return
    answers = weakref.WeakKeyDictionary()

    def get_dofn_specs(dofn):
        try:
            states, timers = answers[dofn]
        except KeyError:
            states, timers = answers[dofn] = ask(dofn)
        except TypeError:
            return ask(dofn)
        return set(states), set(timers)

    get_dofn_specs.memoized = True
    userstate.get_dofn_specs = get_dofn_specs


def memoize_option_views() -> None:
    """Beam's ``PipelineOptions.view_as(cls)``, one view per options object and class for this test process.

    Each call builds a fresh argparse parser of every registered option and parses the flags again (with
    gettext looking up translations for each help text): ~1 ms, and Beam 2.77 asks about 670 times while it
    builds one pipeline of this job, mostly ``view_as(TypeOptions)`` per transform applied — about 0.75 s of
    CPU per pipeline. A view holds no state of its own: it reads and writes the options object's
    ``_all_options``, so one view per (object, class) answers what a new one would. A view whose object has
    since been given another ``_all_options`` is built again, as Beam does."""
    from apache_beam.options.pipeline_options import PipelineOptions

    view_as = PipelineOptions.view_as
    if getattr(view_as, "memoized", False):
        return
    views = weakref.WeakKeyDictionary()

    def memoized_view_as(self, cls):
        try:
            by_class = views.setdefault(self, {})
        except TypeError:  # not weakly referenceable: as Beam does
            return view_as(self, cls)
        view = by_class.get(cls)
        if view is None or view._all_options is not self._all_options:
            view = by_class[cls] = view_as(self, cls)
        return view

    memoized_view_as.memoized = True
    PipelineOptions.view_as = memoized_view_as


def skip_type_hint_tracebacks() -> None:
    """No call stack in the origin of each type hint Beam builds.

    Beam keeps the last five frames of the stack with every type hint it derives (~100 per pipeline) to quote
    them if a type check fails; formatting them stats each frame's source file (~1,300 stats, a third of a
    second per pipeline). A failing type check still fails, naming the transform, without those frames."""
    from apache_beam.typehints import decorators

    decorators.TRACEBACK_LIMIT = 0


def compress_pickles_fast() -> None:
    """Beam's pickled DoFns and coders compressed with bz2 at level 1 instead of 9.

    Beam compresses each of the ~320 pickles of a pipeline's graph at bz2's level 9, whose 900 kB blocks cost
    ~1.2 ms a pickle of a few kB; level 1 costs ~0.8 ms. Any level decompresses the same way, so a worker
    process started without this patch still reads them."""
    import bz2

    from apache_beam.internal import cloudpickle_pickler

    if getattr(cloudpickle_pickler.bz2, "fast", False):
        return

    class FastBz2:
        fast = True
        decompress = staticmethod(bz2.decompress)

        @staticmethod
        def compress(data, compresslevel=9):
            return bz2.compress(data, 1)

    cloudpickle_pickler.bz2 = FastBz2


def install() -> None:
    skip_type_hint_tracebacks()
    compress_pickles_fast()
    memoize_signatures()
    memoize_dofn_specs()
    memoize_option_views()
