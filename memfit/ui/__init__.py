"""``memfit ui``: the planner as a local web page (the ``[ui]`` extra, Gradio).

Plain modules hold everything the page shows, so tests call them directly and nothing here needs a browser:
``form`` (the inputs -> the model, the pool, the planner's arguments and the equivalent ``memfit plan``
command line), ``compute`` (one call of :func:`memfit.plan.search.plan`, the same function and arguments as
``memfit plan``; ``plan --emit``'s files; the matrix and the GPU-count search), ``charts`` (tables for the
plots), ``text`` (the recommendation in words), ``runs`` (run folders and their ``report.html``) and
``handlers`` (what each control calls; a user mistake becomes an inline message). ``page`` builds the
Gradio page and is the only module that imports gradio, inside its functions. Nothing imports torch;
nothing prints.
"""
