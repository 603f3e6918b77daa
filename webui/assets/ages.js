// Relative times that go on counting between refreshes: "12s ago", "in 58 min".
// The server draws them (webui/components.py live_ago / live_until) with the moment they
// refer to (data-ago / data-until) and its own clock at the time (data-now); its "did
// anything change" digest leaves their text out, so a table is not redrawn, and its
// buttons replaced under the pointer, only because a second passed. The same words as
// components._span; the server's clock, not the browser's, so the two never disagree.
(function () {
    function span(s) {
        if (s < 90) { return Math.round(s) + 's'; }
        if (s < 5400) { return Math.round(s / 60) + ' min'; }
        if (s < 2 * 86400) { return Math.round(s / 3600) + ' h'; }
        return Math.round(s / 86400) + ' days';
    }
    function stamp(ts) {
        const d = new Date(ts * 1000);
        const two = function (n) { return String(n).padStart(2, '0'); };
        return d.getFullYear() + '-' + two(d.getMonth() + 1) + '-' + two(d.getDate()) + ' ' +
            two(d.getHours()) + ':' + two(d.getMinutes());
    }
    function serverNow(el) {
        // data-now changes when the server draws the element again: count from there.
        const drawn = el.getAttribute('data-now');
        if (el._twDrawn !== drawn) {
            el._twDrawn = drawn;
            el._twSeen = Date.now() / 1000;
        }
        return parseFloat(drawn) + (Date.now() / 1000 - el._twSeen);
    }
    function tick() {
        document.querySelectorAll('[data-ago]').forEach(function (el) {
            const ts = parseFloat(el.getAttribute('data-ago'));
            const s = Math.max(0, serverNow(el) - ts);
            // Past 90 minutes, the date and time (components.ago), which no longer moves:
            // the server's own words stay; one that crossed it here gets the browser's.
            if (s >= 5400 && !el.textContent.endsWith(' ago')) { return; }
            const text = s < 5400 ? span(s) + ' ago' : stamp(ts);
            if (el.textContent !== text) { el.textContent = text; }
        });
        document.querySelectorAll('[data-until]').forEach(function (el) {
            const s = parseFloat(el.getAttribute('data-until')) - serverNow(el);
            const text = s > 0 ? 'in ' + span(s) : 'ended';
            if (el.textContent !== text) { el.textContent = text; }
        });
    }
    setInterval(tick, 1000);
})();
