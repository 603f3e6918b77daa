// Builds assets/vendor/plotly-scatter-bar-heatmap-<VERSION>.min.js: plotly.js's core (scatter
// and the cartesian axes) with its bar and heatmap traces, nothing else (webui/plotly_js.py).
// From plotly.js's npm source package, with its own esbuild configuration and its dist's
// header and UMD wrapper; needs only npm packages:
//
//   npm pack plotly.js@4.1.1 && tar xzf plotly.js-4.1.1.tgz && cd package
//   npm install --omit=dev --ignore-scripts
//   npm install --no-save --ignore-scripts esbuild@0.28.2 esbuild-plugin-glsl@1.4.2 \
//       esbuild-plugin-environment@0.5.0 esbuild-plugin-inline-css@0.0.1
//   mkdir -p tasks/util && echo "module.exports = {pathToRoot: '.'};" > tasks/util/constants.js
//   cp /path/to/webui/plotly_bundle.js . && node plotly_bundle.js  # build/plotly-scatter-bar-heatmap.min.js
//
// (esbuild's version is plotly.js's own devDependency; built so, 4.1.1 is the vendored file.)
'use strict';

const esbuild = require('esbuild');
const fs = require('fs');
const { esbuildConfig } = require('./esbuild-config.js');
const { version } = require('./package.json');

const ENTRY = './lib/index-scatter-bar-heatmap.js';
const OUT = './build/plotly-scatter-bar-heatmap.min.js';
const header = `/**
* plotly.js (scatter-bar-heatmap - minified) v${version}
* Copyright 2012-2026, Plotly, Inc.
* All rights reserved.
* Licensed under the MIT license
*/
(
 function(root, factory) {
  if (typeof module === "object" && module.exports) {
   module.exports = factory();
  } else {
   root.moduleName = factory();
  }
} (typeof self !== "undefined" ? self : this, () => {
`;
const footer = `
window.Plotly = Plotly;
return Plotly;
}));
`;

fs.writeFileSync(ENTRY, `'use strict';

var Plotly = require('./core');  // scatter is in core

Plotly.register([require('./bar'), require('./heatmap')]);

module.exports = Plotly;
`);
esbuild
    .build({ ...esbuildConfig, entryPoints: [ENTRY], minify: true, write: false, logLevel: 'warning' })
    .then((result) => fs.writeFileSync(OUT, header + result.outputFiles[0].text + footer));
