// validate.mjs: checks on the rendered outbox-relay chart, run by tests/helm/run.
//
//   node validate.mjs manifests FILE.yaml...      schema-check every object with
//        kubernetes-models (built-in kinds) and @kubernetes-models/prometheus-operator
//        (ServiceMonitor, PrometheusRule), then the chart's own policy (pod security,
//        probes, checksum/config, resources)
//   node validate.mjs extract-rules RENDERED.yaml OUT.yaml
//        write the PrometheusRule's spec as a plain Prometheus rule file
//   node validate.mjs dashboard-rules DASHBOARD.json OUT.yaml
//        write each dashboard panel query as a recording rule (Grafana variables
//        replaced) so `promtool check rules` parses every panel's PromQL
//   node validate.mjs metrics docs/DESIGN.md DASHBOARD.json RULES.yaml
//        every outbox_* metric used exists in docs/DESIGN.md's metric table (plus
//        outbox_build_info), with _bucket/_sum/_count only on histograms; the
//        kube-state-metrics series an alert reads (kube_*) are in its table too
//
// Modules are loaded from $NODE_MODULES (the npm cache outside the repo).
import fs from "node:fs";
import path from "node:path";
import { pathToFileURL } from "node:url";

const NM = process.env.NODE_MODULES;
if (!NM) {
  console.error("validate.mjs: set NODE_MODULES to the node_modules directory");
  process.exit(2);
}
const YAML = await import(pathToFileURL(path.join(NM, "yaml/dist/index.js")).href);

let failures = 0;
const fail = (msg) => {
  failures++;
  console.log(`  FAIL ${msg}`);
};
const ok = (msg) => console.log(`  ok   ${msg}`);

function readDocs(file) {
  const docs = YAML.parseAllDocuments(fs.readFileSync(file, "utf8"));
  const out = [];
  for (const d of docs) {
    if (d.errors.length) throw new Error(`${file}: YAML error: ${d.errors[0].message}`);
    const o = d.toJS();
    if (o !== null && o !== undefined) out.push(o);
  }
  return out;
}

// apiVersion/kind -> model class file.
async function modelFor(apiVersion, kind) {
  let file;
  if (apiVersion.startsWith("monitoring.coreos.com/")) {
    file = path.join(NM, "@kubernetes-models/prometheus-operator", apiVersion, `${kind}.js`);
  } else {
    file = path.join(NM, "kubernetes-models", apiVersion, `${kind}.js`);
  }
  if (!fs.existsSync(file)) return null;
  const mod = await import(pathToFileURL(file).href);
  return mod[kind] ?? null;
}

function podSpecOf(o) {
  switch (o.kind) {
    case "Deployment":
    case "StatefulSet":
    case "DaemonSet":
    case "Job":
      return o.spec?.template;
    case "CronJob":
      return o.spec?.jobTemplate?.spec?.template;
    default:
      return null;
  }
}

function checkPolicy(o, where) {
  const tpl = podSpecOf(o);
  if (!tpl) return;
  const spec = tpl.spec ?? {};
  const psc = spec.securityContext ?? {};
  const bad = [];
  if (psc.runAsNonRoot !== true) bad.push("pod runAsNonRoot");
  if (psc.runAsUser !== 65532) bad.push("pod runAsUser 65532");
  if (psc.seccompProfile?.type !== "RuntimeDefault") bad.push("pod seccompProfile RuntimeDefault");
  if (spec.automountServiceAccountToken !== false) bad.push("automountServiceAccountToken false");
  // The migrate hook Job runs before the release's ConfigMap exists: its
  // settings are in env, and it has no checksum to roll.
  const hook = o.kind === "Job" && o.metadata?.annotations?.["helm.sh/hook"];
  if (!hook && !tpl.metadata?.annotations?.["checksum/config"]) bad.push("checksum/config annotation");
  for (const c of spec.containers ?? []) {
    const sc = c.securityContext ?? {};
    if (sc.readOnlyRootFilesystem !== true) bad.push(`${c.name}: readOnlyRootFilesystem`);
    if (sc.allowPrivilegeEscalation !== false) bad.push(`${c.name}: allowPrivilegeEscalation false`);
    if (!(sc.capabilities?.drop ?? []).includes("ALL")) bad.push(`${c.name}: drop ALL`);
    if (!c.resources?.requests?.cpu || !c.resources?.requests?.memory) bad.push(`${c.name}: resource requests`);
    if (!c.resources?.limits?.memory) bad.push(`${c.name}: memory limit`);
    const env = Object.fromEntries((c.env ?? []).map((e) => [e.name, e]));
    if (!env.OUTBOX_DATABASE_URL?.valueFrom?.secretKeyRef) bad.push(`${c.name}: OUTBOX_DATABASE_URL from a secretKeyRef`);
    if (hook) {
      if (!env.OUTBOX_TABLE?.value) bad.push(`${c.name}: OUTBOX_TABLE`);
    } else if (!(c.envFrom ?? []).some((e) => e.configMapRef)) bad.push(`${c.name}: envFrom configMapRef`);
    if ((c.name === "relay" || c.name === "reconcile") && !env.OUTBOX_KAFKA_BOOTSTRAP_SERVERS)
      bad.push(`${c.name}: OUTBOX_KAFKA_BOOTSTRAP_SERVERS`);
    if (o.kind === "Deployment") {
      if (c.livenessProbe?.httpGet?.path !== "/healthz") bad.push(`${c.name}: livenessProbe /healthz`);
      if (c.readinessProbe?.httpGet?.path !== "/readyz") bad.push(`${c.name}: readinessProbe /readyz`);
      if (!(c.ports ?? []).some((p) => p.name === "http" && p.containerPort === 9464)) bad.push(`${c.name}: port http 9464`);
    }
    if (c.name === "sweeper" && o.kind === "CronJob" && !(c.args ?? []).includes("--once")) bad.push(`${c.name}: --once`);
    if (c.name === "reconcile" && (c.command?.[0] !== "outboxctl" || c.args?.[0] !== "reconcile"))
      bad.push("reconcile: outboxctl reconcile");
    if (c.name === "migrate" && (c.command?.[0] !== "outboxctl" || c.args?.[0] !== "migrate"))
      bad.push("migrate: outboxctl migrate");
  }
  if (o.kind === "CronJob" && o.spec.concurrencyPolicy !== "Forbid") bad.push("concurrencyPolicy Forbid");
  if (o.kind === "Job") {
    if (!hook) bad.push("a Job is a Helm hook");
    if (spec.restartPolicy !== "Never") bad.push("restartPolicy Never");
    if (!(o.spec.activeDeadlineSeconds > 0)) bad.push("activeDeadlineSeconds");
  }
  if (bad.length) fail(`${where}: policy: missing ${bad.join(", ")}`);
  else ok(`${where}: pod security, probes, resources, checksum/config`);
}

async function cmdManifests(files) {
  for (const file of files) {
    const label = path.basename(file);
    const objs = readDocs(file);
    if (objs.length === 0) fail(`${label}: no objects rendered`);
    for (const o of objs) {
      const where = `${label}: ${o.kind}/${o.metadata?.name}`;
      if (!o.apiVersion || !o.kind || !o.metadata?.name) {
        fail(`${where}: apiVersion, kind and metadata.name are required`);
        continue;
      }
      const Model = await modelFor(o.apiVersion, o.kind);
      if (!Model) {
        fail(`${where}: no schema for ${o.apiVersion} ${o.kind}`);
        continue;
      }
      try {
        new Model(o).validate();
        ok(`${where}: schema ${o.apiVersion}`);
      } catch (e) {
        fail(`${where}: schema: ${String(e.message).split("\n").slice(0, 5).join("; ")}`);
      }
      if (o.kind === "ConfigMap" && o.metadata.name.endsWith("-dashboard")) {
        for (const [k, v] of Object.entries(o.data ?? {})) {
          try {
            JSON.parse(v);
            ok(`${where}: ${k} is JSON`);
          } catch (e) {
            fail(`${where}: ${k} is not JSON: ${e.message}`);
          }
        }
      }
      checkPolicy(o, where);
    }
  }
}

function cmdExtractRules(rendered, out) {
  const rules = readDocs(rendered).filter((o) => o.kind === "PrometheusRule");
  if (rules.length !== 1) throw new Error(`${rendered}: expected one PrometheusRule, found ${rules.length}`);
  fs.writeFileSync(out, YAML.stringify({ groups: rules[0].spec.groups }));
}

// Grafana variables -> values promtool can parse.
function degrafana(expr) {
  return expr
    .replaceAll("$__rate_interval", "5m")
    .replaceAll("$__interval", "1m")
    .replaceAll("$__range", "1h")
    .replace(/\$\{?(\w+)\}?/g, ".*");
}

function dashboardExprs(file) {
  const dash = JSON.parse(fs.readFileSync(file, "utf8"));
  const out = [];
  const walk = (panels) => {
    for (const p of panels ?? []) {
      for (const t of p.targets ?? []) if (t.expr) out.push({ panel: p.title, expr: t.expr });
      walk(p.panels);
    }
  };
  walk(dash.panels);
  for (const v of dash.templating?.list ?? []) {
    const q = typeof v.query === "string" ? v.query : v.query?.query;
    const m = v.type === "query" && q && /^label_values\((.*),\s*\w+\)$/.exec(q);
    if (m) out.push({ panel: `variable ${v.name}`, expr: m[1] });
  }
  return { dash, exprs: out };
}

// Panels: unique ids, a description, no two overlapping on the grid, and each
// legend's {{label}} kept by the query (an outermost `by (...)` names it, or
// the query aggregates nothing away).
function checkPanels(dash) {
  const ids = new Set();
  const boxes = [];
  const walk = (panels) => {
    for (const p of panels ?? []) {
      if (ids.has(p.id)) fail(`panel id ${p.id} used twice`);
      ids.add(p.id);
      if (p.type !== "row" && !p.description) fail(`panel "${p.title}" has no description`);
      const g = p.gridPos;
      if (!g) fail(`panel "${p.title}" has no gridPos`);
      else {
        for (const b of boxes)
          if (g.x < b.x + b.w && b.x < g.x + g.w && g.y < b.y + b.h && b.y < g.y + g.h)
            fail(`panels "${p.title}" and "${b.title}" overlap`);
        boxes.push({ ...g, title: p.title });
      }
      for (const t of p.targets ?? []) {
        const labels = [...(t.legendFormat ?? "").matchAll(/\{\{\s*(\w+)\s*\}\}/g)].map((m) => m[1]);
        const e = t.expr.replace(/^\s*time\(\)\s*-\s*/, "");
        const by = /^\s*\w+\s+by\s*\(([^)]*)\)/.exec(e) ?? /^\s*\w+\s*\([^]*\)\s*by\s*\(([^)]*)\)\s*$/.exec(e);
        const aggregated = /^\s*(sum|max|min|avg|count|topk|bottomk|quantile|histogram_quantile)\b/.test(e);
        for (const l of labels) {
          const kept = by ? by[1].split(",").map((x) => x.trim()) : [];
          if (aggregated && !kept.includes(l))
            fail(`panel "${p.title}": legend {{${l}}} but the query keeps only (${kept.join(", ")}): ${t.expr}`);
        }
      }
      walk(p.panels);
    }
  };
  walk(dash.panels);
  console.log(`  ok   ${ids.size} panels: unique ids, descriptions, no overlaps, legends match their queries`);
}

function cmdDashboardRules(file, out) {
  const { dash, exprs } = dashboardExprs(file);
  checkPanels(dash);
  const vars = (dash.templating?.list ?? []).map((v) => v.name);
  if (!vars.includes("datasource")) throw new Error(`${file}: no datasource template variable`);
  const rules = exprs.map((e, i) => ({ record: `dashboard:panel_${i}`, expr: degrafana(e.expr) }));
  fs.writeFileSync(out, YAML.stringify({ groups: [{ name: "dashboard-panels", rules }] }));
  console.log(`  ok   ${exprs.length} dashboard queries written as recording rules`);
}

function designMetrics(designFile) {
  const text = fs.readFileSync(designFile, "utf8");
  const types = new Map();
  // Rows of the metric tables: | outbox_name | type | labels |, and the
  // kube-state-metrics series the chart's alerts read: | kube_name | type | ... |
  for (const m of text.matchAll(/^\|\s*((?:outbox|kube)_[a-z0-9_]+)\s*\|\s*(counter|gauge|histogram|summary)\s*\|/gm)) {
    types.set(m[1], m[2]);
  }
  return types;
}

function cmdMetrics(designFile, dashFile, rulesFile) {
  const types = designMetrics(designFile);
  if (types.size < 5) throw new Error(`${designFile}: metric table not found (${types.size} rows)`);
  types.set("outbox_build_info", "gauge");
  console.log(`  ok   docs/DESIGN.md metric table: ${types.size - 1} metrics (+ outbox_build_info)`);
  const uses = [];
  for (const e of dashboardExprs(dashFile).exprs) uses.push({ where: `dashboard "${e.panel}"`, expr: e.expr });
  const rules = YAML.parse(fs.readFileSync(rulesFile, "utf8"));
  for (const g of rules.groups ?? []) {
    for (const r of g.rules ?? []) uses.push({ where: `alert ${r.alert ?? r.record}`, expr: String(r.expr) });
  }
  const used = new Set();
  for (const u of uses) {
    // Drop label matchers' string values so label values are not taken for metrics.
    const expr = u.expr.replace(/"(?:[^"\\]|\\.)*"/g, '""');
    const names = [...expr.matchAll(/\b(?:outbox|kube)_[a-z0-9_]+\b/g)].map((m) => m[0]);
    if (names.length === 0) fail(`${u.where}: uses no outbox_* (or kube_*) metric: ${u.expr}`);
    for (const n of names) {
      let base = n;
      let suffix = null;
      const m = /^(.*)_(bucket|sum|count)$/.exec(n);
      if (!types.has(n) && m && types.has(m[1])) {
        base = m[1];
        suffix = m[2];
      }
      if (!types.has(base)) {
        fail(`${u.where}: metric ${n} is not in docs/DESIGN.md's table`);
        continue;
      }
      const t = types.get(base);
      if (suffix && t !== "histogram") fail(`${u.where}: ${n}: _${suffix} on a ${t}`);
      if (!suffix && t === "histogram") fail(`${u.where}: histogram ${n} used without _bucket/_sum/_count`);
      if (/rate\(|increase\(/.test(u.expr) && t === "gauge" && new RegExp(`(rate|increase)\\(${base}\\b`).test(expr))
        fail(`${u.where}: rate/increase over gauge ${base}`);
      used.add(base);
    }
  }
  console.log(`  ok   ${uses.length} expressions use ${used.size} metrics: ${[...used].sort().join(" ")}`);
  const unused = [...types.keys()].filter((k) => !used.has(k) && k !== "outbox_build_info");
  if (unused.length) fail(`docs/DESIGN.md metrics on no panel or alert: ${unused.join(" ")}`);
}

const [cmd, ...args] = process.argv.slice(2);
try {
  if (cmd === "manifests") await cmdManifests(args);
  else if (cmd === "extract-rules") cmdExtractRules(args[0], args[1]);
  else if (cmd === "dashboard-rules") cmdDashboardRules(args[0], args[1]);
  else if (cmd === "metrics") cmdMetrics(args[0], args[1], args[2]);
  else {
    console.error("usage: validate.mjs manifests|extract-rules|dashboard-rules|metrics ...");
    process.exit(2);
  }
} catch (e) {
  fail(e.message);
}
process.exit(failures ? 1 : 0);
