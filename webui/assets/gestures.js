// Where a pointer button is held down on a graph, and since when, from the page's load:
// webui/gestures.py holds the page's refresh ticks back meanwhile.
(function () {
    const p = window._twPointer = {down: 0, held: 0};
    document.addEventListener('pointerdown', e => {
        const on = e.target && e.target.closest && e.target.closest('.js-plotly-plot');
        if (on && e.button === 0) { p.down = Date.now(); }
    }, true);
    const up = () => { p.down = 0; };
    document.addEventListener('pointerup', up, true);
    document.addEventListener('pointercancel', up, true);
    window.addEventListener('blur', up);
})();
