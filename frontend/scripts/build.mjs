// Bundles frontend/src into tb_nanwatch/board/static/{index.js,style.css}.
//
// Output directory: first CLI argument, else $NANWATCH_STATIC_OUT, else
// ../tb_nanwatch/board/static. The output is deterministic (no timestamps, no
// absolute paths), so `npm ci && npm run build` reproduces the committed files.
import { build } from "esbuild";
import path from "node:path";
import { fileURLToPath } from "node:url";

const root = path.resolve(path.dirname(fileURLToPath(import.meta.url)), "..");
const outdir = path.resolve(
  process.argv[2] || process.env.NANWATCH_STATIC_OUT || path.join(root, "..", "tb_nanwatch", "board", "static"),
);

const common = {
  absWorkingDir: root,
  bundle: true,
  minify: true,
  legalComments: "eof",
  sourcemap: false,
  logLevel: "warning",
  charset: "utf8",
};

await build({
  ...common,
  entryPoints: ["src/index.js"],
  outfile: path.join(outdir, "index.js"),
  format: "esm",
  platform: "browser",
  target: ["es2020"],
});

await build({
  ...common,
  entryPoints: ["src/style.css"],
  outfile: path.join(outdir, "style.css"),
  target: ["chrome100", "firefox100", "safari15"],
});

console.log(`built ${path.relative(process.cwd(), outdir) || "."}/index.js and style.css`);
