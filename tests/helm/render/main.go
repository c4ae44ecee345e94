// render: renders a Helm chart offline the way `helm template` does, for CI machines that have no
// Helm binary. It uses Helm's own template engine pieces — Go text/template, the Sprig function
// library (github.com/Masterminds/sprig, the same FuncMap Helm starts from), and values read
// through YAML->JSON (github.com/ghodss/yaml, the library sigs.k8s.io/yaml forked from), so numbers
// in values are float64 exactly as in Helm — and re-implements Helm's few own pieces:
//
//   - functions include, tpl, required, toYaml, fromYaml, fromYamlArray, toJson, fromJson,
//     fromJsonArray, lookup (offline: an empty map, as in `helm template`); env/expandenv removed;
//   - objects .Values, .Release, .Chart (Chart.yaml fields, Helm's capitalised names), .Capabilities
//     (KubeVersion, APIVersions.Has, HelmVersion), .Template (Name, BasePath) and .Files (Get,
//     GetBytes, Glob, AsConfig, AsSecrets, Lines) with .helmignore;
//   - values: the chart's values.yaml coalesced with the -f files (later files win, maps merge
//     deeply, a null removes a default), then validated against values.schema.json (JSON Schema
//     draft 7, the xeipuuv/gojsonschema library Helm 3 uses) with Helm's error message;
//   - the chart's kubeVersion constraint against --kube-version;
//   - missingkey=zero with "<no value>" removed, partials (_*.tpl) not emitted, NOTES.txt rendered
//     apart, manifests split into documents and printed in Helm's install order with
//     "# Source:" headers, and Helm's "execution error at (file:line:col): message" errors.
//
// Not implemented (the chart does not use them): subcharts/dependencies, library charts, toToml,
// Files.Glob "**" patterns, .Values methods (Values.AsMap etc.), --set.
//
// Built in GOPATH mode against Debian's packages:
//
//	GO111MODULE=off GOPATH=/usr/share/gocode go build -o render ./tests/helm/render
//
// Usage:
//
//	render --chart DIR [-f VALUES.yaml]... [--release NAME] [--namespace NS]
//	       [--kube-version 1.30.0] [--api-versions group/version,...] [--notes FILE] [--out FILE]
package main

import (
	"bytes"
	"encoding/base64"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"os"
	"path"
	"path/filepath"
	"regexp"
	"sort"
	"strings"
	"text/template"

	"github.com/Masterminds/semver"
	"github.com/Masterminds/sprig"
	"github.com/ghodss/yaml"
	"github.com/xeipuuv/gojsonschema"
)

// ---------------------------------------------------------------------------------------------
// Chart metadata (Chart.yaml), with the field names templates use (.Chart.Name, .Chart.AppVersion).

type Maintainer struct {
	Name  string `json:"name,omitempty"`
	Email string `json:"email,omitempty"`
	URL   string `json:"url,omitempty"`
}

type Dependency struct {
	Name       string `json:"name"`
	Version    string `json:"version,omitempty"`
	Repository string `json:"repository"`
	Condition  string `json:"condition,omitempty"`
}

type Metadata struct {
	Name         string            `json:"name,omitempty"`
	Home         string            `json:"home,omitempty"`
	Sources      []string          `json:"sources,omitempty"`
	Version      string            `json:"version,omitempty"`
	Description  string            `json:"description,omitempty"`
	Keywords     []string          `json:"keywords,omitempty"`
	Maintainers  []*Maintainer     `json:"maintainers,omitempty"`
	Icon         string            `json:"icon,omitempty"`
	APIVersion   string            `json:"apiVersion,omitempty"`
	Condition    string            `json:"condition,omitempty"`
	Tags         string            `json:"tags,omitempty"`
	AppVersion   string            `json:"appVersion,omitempty"`
	Deprecated   bool              `json:"deprecated,omitempty"`
	Annotations  map[string]string `json:"annotations,omitempty"`
	KubeVersion  string            `json:"kubeVersion,omitempty"`
	Dependencies []*Dependency     `json:"dependencies,omitempty"`
	Type         string            `json:"type,omitempty"`
}

func (m *Metadata) validate() error {
	if m.APIVersion != "v2" {
		return fmt.Errorf("Chart.yaml: apiVersion must be v2, not %q", m.APIVersion)
	}
	if m.Name == "" {
		return errors.New("Chart.yaml: name is required")
	}
	if _, err := semver.StrictNewVersion(m.Version); err != nil {
		return fmt.Errorf("Chart.yaml: version %q is not a SemVer 2 version", m.Version)
	}
	if m.Type != "" && m.Type != "application" {
		return fmt.Errorf("Chart.yaml: type %q is not supported by this renderer", m.Type)
	}
	if len(m.Dependencies) > 0 {
		return errors.New("Chart.yaml: dependencies are not supported by this renderer")
	}
	return nil
}

// ---------------------------------------------------------------------------------------------
// .Capabilities and .Release

type KubeVersion struct {
	Version    string
	Major      string
	Minor      string
	GitVersion string
}

func (k KubeVersion) String() string { return k.Version }

type VersionSet []string

func (v VersionSet) Has(apiVersion string) bool {
	for _, x := range v {
		if x == apiVersion {
			return true
		}
	}
	return false
}

type HelmVersion struct {
	Version      string
	GitCommit    string
	GitTreeState string
	GoVersion    string
}

type Capabilities struct {
	KubeVersion KubeVersion
	APIVersions VersionSet
	HelmVersion HelmVersion
}

// The group/versions (and group/version/kind forms Helm also lists) a stock cluster serves.
var builtinAPIVersions = []string{
	"v1", "apps/v1", "batch/v1", "autoscaling/v1", "autoscaling/v2", "policy/v1",
	"networking.k8s.io/v1", "rbac.authorization.k8s.io/v1", "storage.k8s.io/v1",
	"apiextensions.k8s.io/v1", "admissionregistration.k8s.io/v1", "coordination.k8s.io/v1",
	"discovery.k8s.io/v1", "events.k8s.io/v1", "scheduling.k8s.io/v1", "node.k8s.io/v1",
	"certificates.k8s.io/v1", "apiregistration.k8s.io/v1", "authentication.k8s.io/v1",
	"authorization.k8s.io/v1",
}

type Release struct {
	Name      string
	Namespace string
	IsUpgrade bool
	IsInstall bool
	Revision  int
	Service   string
}

// ---------------------------------------------------------------------------------------------
// .Files

type Files map[string][]byte

func (f Files) GetBytes(name string) []byte { return f[name] }
func (f Files) Get(name string) string      { return string(f[name]) }

// Glob returns the files whose names match pattern (path.Match syntax; "/" separates folders).
func (f Files) Glob(pattern string) Files {
	out := Files{}
	for name, data := range f {
		if ok, _ := path.Match(pattern, name); ok {
			out[name] = data
		}
	}
	return out
}

// AsConfig: the files as a ConfigMap's data block (base names as keys).
func (f Files) AsConfig() string {
	if len(f) == 0 {
		return ""
	}
	m := map[string]string{}
	for name, data := range f {
		m[path.Base(name)] = string(data)
	}
	return toYAML(m)
}

// AsSecrets: the files as a Secret's data block (base64).
func (f Files) AsSecrets() string {
	if len(f) == 0 {
		return ""
	}
	m := map[string]string{}
	for name, data := range f {
		m[path.Base(name)] = base64.StdEncoding.EncodeToString(data)
	}
	return toYAML(m)
}

func (f Files) Lines(name string) []string {
	data, ok := f[name]
	if !ok {
		return []string{}
	}
	s := string(data)
	if strings.HasSuffix(s, "\n") {
		s = s[:len(s)-1]
	}
	return strings.Split(s, "\n")
}

// ---------------------------------------------------------------------------------------------
// YAML/JSON helpers, as in Helm's engine/funcs.go.

func toYAML(v interface{}) string {
	data, err := yaml.Marshal(v)
	if err != nil {
		return ""
	}
	return strings.TrimSuffix(string(data), "\n")
}

func fromYAML(s string) map[string]interface{} {
	m := map[string]interface{}{}
	if err := yaml.Unmarshal([]byte(s), &m); err != nil {
		m["Error"] = err.Error()
	}
	return m
}

func fromYAMLArray(s string) []interface{} {
	a := []interface{}{}
	if err := yaml.Unmarshal([]byte(s), &a); err != nil {
		a = []interface{}{err.Error()}
	}
	return a
}

func toJSON(v interface{}) string {
	data, err := json.Marshal(v)
	if err != nil {
		return ""
	}
	return string(data)
}

func fromJSON(s string) map[string]interface{} {
	m := map[string]interface{}{}
	if err := json.Unmarshal([]byte(s), &m); err != nil {
		m["Error"] = err.Error()
	}
	return m
}

func fromJSONArray(s string) []interface{} {
	a := []interface{}{}
	if err := json.Unmarshal([]byte(s), &a); err != nil {
		a = []interface{}{err.Error()}
	}
	return a
}

// ---------------------------------------------------------------------------------------------
// Values: read, merge (-f files), coalesce with the chart's defaults, validate against the schema.

func readValues(file string) (map[string]interface{}, error) {
	data, err := os.ReadFile(file)
	if err != nil {
		return nil, err
	}
	vals := map[string]interface{}{}
	if err := yaml.Unmarshal(data, &vals); err != nil {
		return nil, fmt.Errorf("failed to parse %s: %w", file, err)
	}
	if vals == nil {
		vals = map[string]interface{}{}
	}
	return vals, nil
}

// mergeMaps: b over a, maps merged deeply (Helm's values.go mergeMaps for -f files).
func mergeMaps(a, b map[string]interface{}) map[string]interface{} {
	out := make(map[string]interface{}, len(a))
	for k, v := range a {
		out[k] = v
	}
	for k, v := range b {
		if vm, ok := v.(map[string]interface{}); ok {
			if bv, ok := out[k]; ok {
				if bm, ok := bv.(map[string]interface{}); ok {
					out[k] = mergeMaps(bm, vm)
					continue
				}
			}
		}
		out[k] = v
	}
	return out
}

// coalesce: the user's values over the chart's defaults (Helm's chartutil.CoalesceTables): a null
// from the user deletes the default, maps merge, anything else from the user wins.
func coalesce(user, defaults map[string]interface{}) map[string]interface{} {
	if user == nil {
		user = map[string]interface{}{}
	}
	for k, dv := range defaults {
		uv, present := user[k]
		switch {
		case !present:
			user[k] = deepCopy(dv)
		case uv == nil:
			delete(user, k)
		default:
			um, uok := uv.(map[string]interface{})
			dm, dok := dv.(map[string]interface{})
			if uok && dok {
				user[k] = coalesce(um, dm)
			}
		}
	}
	// Nulls the user set for keys without defaults are removed too.
	for k, v := range user {
		if v == nil {
			delete(user, k)
		}
	}
	return user
}

func deepCopy(v interface{}) interface{} {
	switch t := v.(type) {
	case map[string]interface{}:
		m := make(map[string]interface{}, len(t))
		for k, x := range t {
			m[k] = deepCopy(x)
		}
		return m
	case []interface{}:
		a := make([]interface{}, len(t))
		for i, x := range t {
			a[i] = deepCopy(x)
		}
		return a
	default:
		return v
	}
}

func validateSchema(chartName string, schema []byte, values map[string]interface{}) error {
	valuesJSON, err := json.Marshal(values)
	if err != nil {
		return err
	}
	result, err := gojsonschema.Validate(gojsonschema.NewBytesLoader(schema), gojsonschema.NewBytesLoader(valuesJSON))
	if err != nil {
		return fmt.Errorf("values.schema.json: %w", err)
	}
	if result.Valid() {
		return nil
	}
	var sb strings.Builder
	for _, e := range result.Errors() {
		fmt.Fprintf(&sb, "- %s\n", e)
	}
	return fmt.Errorf("values don't meet the specifications of the schema(s) in the following chart(s):\n%s:\n%s",
		chartName, sb.String())
}

// ---------------------------------------------------------------------------------------------
// .helmignore (the subset of its syntax charts use: blank lines, # comments, globs matched against
// the base name or the whole path, a trailing "/" for folders, a leading "!" to re-include).

type ignoreRule struct {
	pattern string
	dirOnly bool
	negate  bool
}

func readHelmignore(chartDir string) []ignoreRule {
	data, err := os.ReadFile(filepath.Join(chartDir, ".helmignore"))
	if err != nil {
		return nil
	}
	var rules []ignoreRule
	for _, line := range strings.Split(string(data), "\n") {
		line = strings.TrimSpace(line)
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		r := ignoreRule{}
		if strings.HasPrefix(line, "!") {
			r.negate = true
			line = line[1:]
		}
		if strings.HasSuffix(line, "/") {
			r.dirOnly = true
			line = strings.TrimSuffix(line, "/")
		}
		r.pattern = strings.TrimPrefix(line, "/")
		rules = append(rules, r)
	}
	return rules
}

func ignored(rules []ignoreRule, rel string, isDir bool) bool {
	out := false
	for _, r := range rules {
		if r.dirOnly && !isDir {
			continue
		}
		matched := false
		if ok, _ := path.Match(r.pattern, rel); ok {
			matched = true
		} else if !strings.Contains(r.pattern, "/") {
			if ok, _ := path.Match(r.pattern, path.Base(rel)); ok {
				matched = true
			}
		}
		if matched {
			out = !r.negate
		}
	}
	return out
}

// ---------------------------------------------------------------------------------------------
// Loading the chart directory.

type Chart struct {
	Metadata  *Metadata
	Values    map[string]interface{}
	Schema    []byte
	Templates map[string]string // "templates/x.yaml" -> source
	Files     Files             // every other file, as .Files sees it
}

func loadChart(dir string) (*Chart, error) {
	c := &Chart{Templates: map[string]string{}, Files: Files{}}
	raw, err := os.ReadFile(filepath.Join(dir, "Chart.yaml"))
	if err != nil {
		return nil, fmt.Errorf("not a chart directory: %w", err)
	}
	c.Metadata = &Metadata{}
	if err := yaml.Unmarshal(raw, c.Metadata); err != nil {
		return nil, fmt.Errorf("Chart.yaml: %w", err)
	}
	if err := c.Metadata.validate(); err != nil {
		return nil, err
	}
	c.Values = map[string]interface{}{}
	if _, err := os.Stat(filepath.Join(dir, "values.yaml")); err == nil {
		if c.Values, err = readValues(filepath.Join(dir, "values.yaml")); err != nil {
			return nil, err
		}
	}
	if s, err := os.ReadFile(filepath.Join(dir, "values.schema.json")); err == nil {
		c.Schema = s
	}
	rules := readHelmignore(dir)
	// Walk the chart, following symlinks (as Helm's loader does).
	var walk func(abs, rel string) error
	walk = func(abs, rel string) error {
		entries, err := os.ReadDir(abs)
		if err != nil {
			return err
		}
		for _, e := range entries {
			childAbs := filepath.Join(abs, e.Name())
			childRel := path.Join(rel, e.Name())
			info, err := os.Stat(childAbs) // follows links
			if err != nil {
				return fmt.Errorf("%s: %w", childRel, err)
			}
			if ignored(rules, childRel, info.IsDir()) {
				continue
			}
			if info.IsDir() {
				if err := walk(childAbs, childRel); err != nil {
					return err
				}
				continue
			}
			if !info.Mode().IsRegular() {
				continue
			}
			data, err := os.ReadFile(childAbs)
			if err != nil {
				return err
			}
			switch {
			case childRel == "Chart.yaml" || childRel == "values.yaml" || childRel == "values.schema.json" ||
				childRel == "Chart.lock" || childRel == "requirements.yaml":
			case strings.HasPrefix(childRel, "templates/"):
				c.Templates[childRel] = string(data)
			case strings.HasPrefix(childRel, "charts/"):
				return errors.New("subcharts (charts/) are not supported by this renderer")
			default:
				c.Files[childRel] = data
			}
		}
		return nil
	}
	if err := walk(dir, ""); err != nil {
		return nil, err
	}
	return c, nil
}

// ---------------------------------------------------------------------------------------------
// The engine.

const (
	warnStart = "HELM_ERR_START"
	warnEnd   = "HELM_ERR_END"
)

var warnRegex = regexp.MustCompile(warnStart + `((?s).*)` + warnEnd)

type engine struct {
	t        *template.Template
	included map[string]int
}

func (e *engine) funcMap() template.FuncMap {
	f := sprig.TxtFuncMap()
	delete(f, "env")
	delete(f, "expandenv")
	extra := template.FuncMap{
		"toYaml":        toYAML,
		"fromYaml":      fromYAML,
		"fromYamlArray": fromYAMLArray,
		"toJson":        toJSON,
		"fromJson":      fromJSON,
		"fromJsonArray": fromJSONArray,
		"lookup": func(apiVersion, kind, namespace, name string) (map[string]interface{}, error) {
			return map[string]interface{}{}, nil // `helm template` has no cluster
		},
		"include": func(name string, data interface{}) (string, error) {
			if e.included[name] > 1000 {
				return "", fmt.Errorf("rendering template has a nested reference name: %s", name)
			}
			e.included[name]++
			defer func() { e.included[name]-- }()
			var buf strings.Builder
			err := e.t.ExecuteTemplate(&buf, name, data)
			return buf.String(), err
		},
		"tpl": func(src string, vals map[string]interface{}) (string, error) {
			name := "tpl"
			if tmpl, ok := vals["Template"].(map[string]interface{}); ok {
				if n, ok := tmpl["Name"].(string); ok {
					name = n
				}
			}
			clone, err := e.t.Clone()
			if err != nil {
				return "", err
			}
			t, err := clone.New(name + "#tpl").Parse(src)
			if err != nil {
				return "", fmt.Errorf("error during tpl function execution for %q: %w", src, err)
			}
			var buf strings.Builder
			if err := t.Execute(&buf, vals); err != nil {
				return "", fmt.Errorf("error during tpl function execution for %q: %w", src, err)
			}
			return strings.ReplaceAll(buf.String(), "<no value>", ""), nil
		},
		"required": func(warn string, val interface{}) (interface{}, error) {
			if val == nil {
				return val, errors.New(warnStart + warn + warnEnd)
			}
			if s, ok := val.(string); ok && s == "" {
				return val, errors.New(warnStart + warn + warnEnd)
			}
			return val, nil
		},
	}
	for k, v := range extra {
		f[k] = v
	}
	return f
}

// cleanExecError turns text/template's error into Helm's "execution error at (FILE:L:C): MESSAGE".
func cleanExecError(name string, err error) error {
	var execErr template.ExecError
	if !errors.As(err, &execErr) {
		return fmt.Errorf("execution error in (%s): %w", name, err)
	}
	msg := err.Error()
	tokens := strings.SplitN(msg, ": ", 3)
	if len(tokens) != 3 {
		return fmt.Errorf("execution error in (%s): %s", name, msg)
	}
	location := tokens[1]
	if m := warnRegex.FindStringSubmatch(tokens[2]); len(m) >= 2 {
		return fmt.Errorf("execution error at (%s): %s", location, m[1])
	}
	if i := strings.Index(tokens[2], "error calling fail: "); i >= 0 {
		return fmt.Errorf("execution error at (%s): %s", location, tokens[2][i+len("error calling fail: "):])
	}
	return fmt.Errorf("execution error at (%s): %s", location, tokens[2])
}

// Helm's template order: deeper paths first, then by name (so that later definitions win the same
// way they do in Helm).
func sortTemplates(names []string) {
	sort.Slice(names, func(i, j int) bool {
		a, b := names[i], names[j]
		ca, cb := strings.Count(a, "/"), strings.Count(b, "/")
		if ca == cb {
			return a > b
		}
		return ca > cb
	})
}

type rendered struct {
	name    string // shardserve/templates/x.yaml
	content string
}

func render(c *Chart, top map[string]interface{}) ([]rendered, string, error) {
	e := &engine{included: map[string]int{}}
	e.t = template.New("gotpl")
	e.t.Option("missingkey=zero")
	e.t.Funcs(e.funcMap())
	var names []string
	for rel := range c.Templates {
		names = append(names, path.Join(c.Metadata.Name, rel))
	}
	sortTemplates(names)
	for _, name := range names {
		rel := strings.TrimPrefix(name, c.Metadata.Name+"/")
		if _, err := e.t.New(name).Parse(c.Templates[rel]); err != nil {
			return nil, "", fmt.Errorf("parse error in (%s): %w", name, err)
		}
	}
	var out []rendered
	notes := ""
	for _, name := range names {
		if strings.HasPrefix(path.Base(name), "_") {
			continue
		}
		vals := map[string]interface{}{}
		for k, v := range top {
			vals[k] = v
		}
		vals["Template"] = map[string]interface{}{"Name": name, "BasePath": path.Join(c.Metadata.Name, "templates")}
		var buf strings.Builder
		if err := e.t.ExecuteTemplate(&buf, name, vals); err != nil {
			return nil, "", cleanExecError(name, err)
		}
		text := strings.ReplaceAll(buf.String(), "<no value>", "")
		if path.Base(name) == "NOTES.txt" {
			if path.Dir(name) == path.Join(c.Metadata.Name, "templates") {
				notes = text
			}
			continue
		}
		out = append(out, rendered{name: name, content: text})
	}
	return out, notes, nil
}

// ---------------------------------------------------------------------------------------------
// Output: documents in Helm's install order (releaseutil.InstallOrder), each with its Source.

var installOrder = []string{
	"PriorityClass", "Namespace", "NetworkPolicy", "ResourceQuota", "LimitRange", "PodSecurityPolicy",
	"PodDisruptionBudget", "ServiceAccount", "Secret", "SecretList", "ConfigMap", "StorageClass",
	"PersistentVolume", "PersistentVolumeClaim", "CustomResourceDefinition", "ClusterRole",
	"ClusterRoleList", "ClusterRoleBinding", "ClusterRoleBindingList", "Role", "RoleList", "RoleBinding",
	"RoleBindingList", "Service", "DaemonSet", "Pod", "ReplicationController", "ReplicaSet",
	"Deployment", "HorizontalPodAutoscaler", "StatefulSet", "Job", "CronJob", "IngressClass", "Ingress",
	"APIService",
}

var docSep = regexp.MustCompile(`(?m)^---\s*$`)

type manifest struct {
	source  string
	kind    string
	name    string
	content string
	hook    bool
}

func splitManifests(files []rendered) ([]manifest, error) {
	var out []manifest
	for _, f := range files {
		for _, doc := range docSep.Split(f.content, -1) {
			if strings.TrimSpace(doc) == "" {
				continue
			}
			var head struct {
				Kind     string `json:"kind"`
				Metadata struct {
					Name        string            `json:"name"`
					Annotations map[string]string `json:"annotations"`
				} `json:"metadata"`
			}
			if err := yaml.Unmarshal([]byte(doc), &head); err != nil {
				return nil, fmt.Errorf("YAML parse error on %s: %w", f.name, err)
			}
			isEmpty := true
			for _, line := range strings.Split(doc, "\n") {
				t := strings.TrimSpace(line)
				if t != "" && !strings.HasPrefix(t, "#") {
					isEmpty = false
				}
			}
			if isEmpty {
				continue
			}
			if head.Kind == "" {
				return nil, fmt.Errorf("%s: a manifest without kind", f.name)
			}
			_, hook := head.Metadata.Annotations["helm.sh/hook"]
			out = append(out, manifest{source: f.name, kind: head.Kind, name: head.Metadata.Name,
				content: strings.Trim(doc, "\n"), hook: hook})
		}
	}
	rank := func(kind string) int {
		for i, k := range installOrder {
			if k == kind {
				return i
			}
		}
		return len(installOrder)
	}
	sort.SliceStable(out, func(i, j int) bool {
		if out[i].hook != out[j].hook {
			return !out[i].hook // hooks after the release's manifests, as `helm template` prints them
		}
		ri, rj := rank(out[i].kind), rank(out[j].kind)
		if ri != rj {
			return ri < rj
		}
		if ri == len(installOrder) && out[i].kind != out[j].kind {
			return out[i].kind < out[j].kind
		}
		return out[i].name < out[j].name
	})
	return out, nil
}

// ---------------------------------------------------------------------------------------------

type multiFlag []string

func (m *multiFlag) String() string     { return strings.Join(*m, ",") }
func (m *multiFlag) Set(v string) error { *m = append(*m, v); return nil }

func run() error {
	var valueFiles multiFlag
	chartDir := flag.String("chart", "", "chart directory")
	flag.Var(&valueFiles, "f", "values file (repeatable; later files win)")
	flag.Var(&valueFiles, "values", "same as -f")
	releaseName := flag.String("release", "release-name", "release name")
	namespace := flag.String("namespace", "default", "release namespace")
	kubeVersion := flag.String("kube-version", "1.30.0", "Kubernetes version for .Capabilities and kubeVersion")
	apiVersions := flag.String("api-versions", "", "extra API versions for .Capabilities.APIVersions, comma-separated")
	notesOut := flag.String("notes", "", "write the rendered NOTES.txt here")
	outFile := flag.String("out", "", "write the manifests here instead of stdout")
	flag.Parse()
	if *chartDir == "" || flag.NArg() > 0 {
		return errors.New("usage: render --chart DIR [-f values.yaml]... [--release NAME] [--namespace NS] " +
			"[--kube-version X.Y.Z] [--api-versions a/v1,...] [--notes FILE] [--out FILE]")
	}
	c, err := loadChart(*chartDir)
	if err != nil {
		return err
	}
	kv, err := semver.NewVersion(*kubeVersion)
	if err != nil {
		return fmt.Errorf("--kube-version %q: %w", *kubeVersion, err)
	}
	if c.Metadata.KubeVersion != "" {
		constraint, err := semver.NewConstraint(c.Metadata.KubeVersion)
		if err != nil {
			return fmt.Errorf("Chart.yaml: kubeVersion %q: %w", c.Metadata.KubeVersion, err)
		}
		if !constraint.Check(kv) {
			return fmt.Errorf("chart requires kubeVersion: %s which is incompatible with Kubernetes v%s",
				c.Metadata.KubeVersion, kv.String())
		}
	}
	if len(*releaseName) > 53 {
		return errors.New("release name is invalid: longer than 53 characters")
	}
	user := map[string]interface{}{}
	for _, f := range valueFiles {
		v, err := readValues(f)
		if err != nil {
			return err
		}
		user = mergeMaps(user, v)
	}
	values := coalesce(user, deepCopy(c.Values).(map[string]interface{}))
	if c.Schema != nil {
		if err := validateSchema(c.Metadata.Name, c.Schema, values); err != nil {
			return err
		}
	}
	versions := append(VersionSet{}, builtinAPIVersions...)
	if *apiVersions != "" {
		versions = append(versions, strings.Split(*apiVersions, ",")...)
	}
	top := map[string]interface{}{
		"Values": values,
		"Release": Release{Name: *releaseName, Namespace: *namespace, IsInstall: true, Revision: 1,
			Service: "Helm"},
		"Chart": c.Metadata,
		"Capabilities": Capabilities{
			KubeVersion: KubeVersion{Version: "v" + kv.String(), Major: fmt.Sprint(kv.Major()),
				Minor: fmt.Sprint(kv.Minor()), GitVersion: "v" + kv.String()},
			APIVersions: versions,
			HelmVersion: HelmVersion{Version: "v3.14.0", GoVersion: "go1.19"},
		},
		"Files": c.Files,
	}
	files, notes, err := render(c, top)
	if err != nil {
		return err
	}
	manifests, err := splitManifests(files)
	if err != nil {
		return err
	}
	var buf bytes.Buffer
	for _, m := range manifests {
		fmt.Fprintf(&buf, "---\n# Source: %s\n%s\n", m.source, m.content)
	}
	if *outFile != "" {
		if err := os.WriteFile(*outFile, buf.Bytes(), 0o644); err != nil {
			return err
		}
	} else if _, err := os.Stdout.Write(buf.Bytes()); err != nil {
		return err
	}
	if *notesOut != "" {
		if err := os.WriteFile(*notesOut, []byte(notes), 0o644); err != nil {
			return err
		}
	}
	return nil
}

func main() {
	if err := run(); err != nil {
		fmt.Fprintf(os.Stderr, "Error: %s\n", err)
		os.Exit(1)
	}
}
