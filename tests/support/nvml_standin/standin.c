/*
 * standin.c - a scriptable stand-in for libnvidia-ml.so.1.  TEST CODE ONLY, never packaged.
 *
 * Compiled at test time against NVIDIA's own nvml.h (PyPI nvidia-nvml-dev), so every exported
 * function has the header's exact prototype and every struct the header's exact layout.  The real
 * pynvml loads it as "libnvidia-ml.so.1" (LD_LIBRARY_PATH, or a preload matched by SONAME).
 *
 * State lives in a JSON file named by $NVML_STANDIN_STATE (schema: docs/nvml-standin.md).  Every
 * call stat()s the file and re-parses it when device, inode, size, mtime or ctime changed, so a
 * test can change GPU state while the process under test keeps running.  A file that cannot be
 * read or parsed makes every call return NVML_ERROR_UNKNOWN and prints the reason to stderr.
 *
 * Rules shared by all device queries:
 *   - library not initialised                      -> NVML_ERROR_UNINITIALIZED
 *   - handle not one of ours                        -> NVML_ERROR_INVALID_ARGUMENT
 *   - an "errors" entry matches (function, gpu)     -> that code
 *   - handle index >= current device count          -> NVML_ERROR_GPU_IS_LOST
 *   - the value is absent (or null) in the state    -> NVML_ERROR_NOT_SUPPORTED
 * Only functions declared in nvml.h are exported, plus nvml_standin_reset() for in-process use.
 */
#define _GNU_SOURCE
#include <nvml.h>

#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>

#define MAX_GPUS 64
#define SET_MAGIC 0x5e75e75eu

/* ===================================================================== minimal JSON DOM === */
/* Nodes live in one growable array and link by index; strings are unescaped in place. */
enum { J_NULL, J_FALSE, J_TRUE, J_NUM, J_STR, J_ARR, J_OBJ };

typedef struct {
    int type;
    int neg, is_int;          /* J_NUM: sign, and whether the text was a plain integer */
    unsigned long long u;     /* J_NUM: magnitude when is_int */
    double d;                 /* J_NUM: value as double */
    const char *s;            /* J_STR: NUL-terminated text */
    const char *key;          /* member name when the node sits in an object */
    int first, next;          /* first child, next sibling (-1: none) */
} jnode;

typedef struct {
    char *p, *end;
    jnode *n;
    int len, cap;
    const char *err;
} jparser;

static int jnew(jparser *P, int type)
{
    if (P->len == P->cap) {
        int cap = P->cap ? P->cap * 2 : 256;
        jnode *n = realloc(P->n, (size_t)cap * sizeof *n);
        if (!n) { P->err = "out of memory"; return -1; }
        P->n = n;
        P->cap = cap;
    }
    memset(&P->n[P->len], 0, sizeof P->n[0]);
    P->n[P->len].type = type;
    P->n[P->len].first = P->n[P->len].next = -1;
    return P->len++;
}

static void jws(jparser *P)
{
    while (P->p < P->end && (*P->p == ' ' || *P->p == '\t' || *P->p == '\n' || *P->p == '\r'))
        P->p++;
}

static int hexval(char c)
{
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
}

/* Parses a string starting at the opening quote; returns its start (unescaped, NUL-terminated). */
static char *jstring(jparser *P)
{
    char *start = ++P->p, *w = start;
    while (P->p < P->end) {
        char c = *P->p++;
        if (c == '"') { *w = '\0'; return start; }
        if ((unsigned char)c < 0x20) break;
        if (c != '\\') { *w++ = c; continue; }
        if (P->p >= P->end) break;
        c = *P->p++;
        switch (c) {
        case '"': case '\\': case '/': *w++ = c; break;
        case 'b': *w++ = '\b'; break;
        case 'f': *w++ = '\f'; break;
        case 'n': *w++ = '\n'; break;
        case 'r': *w++ = '\r'; break;
        case 't': *w++ = '\t'; break;
        case 'u': {
            unsigned cp = 0;
            for (int i = 0; i < 4; i++) {
                int h = P->p < P->end ? hexval(*P->p++) : -1;
                if (h < 0) { P->err = "bad \\u escape"; return NULL; }
                cp = cp << 4 | (unsigned)h;
            }
            if (cp >= 0xD800 && cp <= 0xDFFF) { P->err = "surrogate \\u escapes unsupported"; return NULL; }
            if (cp < 0x80) { *w++ = (char)cp; }
            else if (cp < 0x800) { *w++ = (char)(0xC0 | cp >> 6); *w++ = (char)(0x80 | (cp & 0x3F)); }
            else {
                *w++ = (char)(0xE0 | cp >> 12);
                *w++ = (char)(0x80 | ((cp >> 6) & 0x3F));
                *w++ = (char)(0x80 | (cp & 0x3F));
            }
            break;
        }
        default: P->err = "bad escape"; return NULL;
        }
    }
    if (!P->err) P->err = "unterminated string";
    return NULL;
}

static int jvalue(jparser *P, int depth);

static int jcontainer(jparser *P, int depth, int type, char close)
{
    int self = jnew(P, type), last = -1;
    if (self < 0) return -1;
    P->p++;
    jws(P);
    if (P->p < P->end && *P->p == close) { P->p++; return self; }
    for (;;) {
        const char *key = NULL;
        jws(P);
        if (type == J_OBJ) {
            if (P->p >= P->end || *P->p != '"') { P->err = "expected member name"; return -1; }
            if (!(key = jstring(P))) return -1;
            jws(P);
            if (P->p >= P->end || *P->p != ':') { P->err = "expected ':'"; return -1; }
            P->p++;
        }
        int child = jvalue(P, depth + 1);
        if (child < 0) return -1;
        P->n[child].key = key;
        if (last < 0) P->n[self].first = child; else P->n[last].next = child;
        last = child;
        jws(P);
        if (P->p < P->end && *P->p == ',') { P->p++; continue; }
        if (P->p < P->end && *P->p == close) { P->p++; return self; }
        P->err = type == J_OBJ ? "expected ',' or '}'" : "expected ',' or ']'";
        return -1;
    }
}

static int jvalue(jparser *P, int depth)
{
    if (depth > 32) { P->err = "nesting too deep"; return -1; }
    jws(P);
    if (P->p >= P->end) { P->err = "unexpected end of input"; return -1; }
    char c = *P->p;
    if (c == '{') return jcontainer(P, depth, J_OBJ, '}');
    if (c == '[') return jcontainer(P, depth, J_ARR, ']');
    if (c == '"') {
        char *s = jstring(P);
        int i = s ? jnew(P, J_STR) : -1;
        if (i >= 0) P->n[i].s = s;
        return i;
    }
    static const struct { const char *word; int type; } words[] = {
        {"null", J_NULL}, {"true", J_TRUE}, {"false", J_FALSE}};
    for (size_t k = 0; k < sizeof words / sizeof words[0]; k++) {
        size_t len = strlen(words[k].word);
        if ((size_t)(P->end - P->p) >= len && memcmp(P->p, words[k].word, len) == 0) {
            P->p += len;
            return jnew(P, words[k].type);
        }
    }
    if (c == '-' || (c >= '0' && c <= '9')) {
        char *q = P->p, *endp;
        int i = jnew(P, J_NUM);
        if (i < 0) return -1;
        jnode *n = &P->n[i];
        n->neg = (*q == '-');
        if (n->neg) q++;
        char *digits = q;
        while (q < P->end && *q >= '0' && *q <= '9') q++;
        n->is_int = q > digits && (q >= P->end || (*q != '.' && *q != 'e' && *q != 'E'));
        errno = 0;
        n->d = strtod(P->p, &endp);
        if (endp == P->p || errno == ERANGE) { P->err = "bad number"; return -1; }
        if (n->is_int) {
            errno = 0;
            n->u = strtoull(digits, NULL, 10);
            if (errno == ERANGE) { P->err = "integer out of range"; return -1; }
        }
        P->p = endp;
        return i;
    }
    P->err = "unexpected character";
    return -1;
}

/* ======================================================================== state model === */
enum {
    S_MEM_TOTAL, S_MEM_USED, S_MEM_RESERVED, S_UTIL_GPU, S_UTIL_MEM, S_POWER, S_POWER_LIMIT,
    S_TEMP, S_CLK_GRAPHICS, S_CLK_SM, S_CLK_MEM, S_CLK_VIDEO, S_EVENT_TYPES,
    S_PCIE_GEN_CUR, S_PCIE_GEN_MAX, S_PCIE_WIDTH_CUR, S_PCIE_WIDTH_MAX,
    S_CLK_GRAPHICS_MAX, S_CLK_SM_MAX, S_CLK_MEM_MAX, S_CLK_VIDEO_MAX, S_CLOCKS_EVENT_REASONS, N_SCALARS
};
static const char *const scalar_names[N_SCALARS] = {
    "memory_total", "memory_used", "memory_reserved", "utilization_gpu", "utilization_memory",
    "power_mw", "power_limit_mw", "temperature_c", "clock_graphics_mhz", "clock_sm_mhz",
    "clock_mem_mhz", "clock_video_mhz", "supported_event_types",
    "pcie_link_gen_current", "pcie_link_gen_max", "pcie_link_width_current", "pcie_link_width_max",
    "clock_graphics_max_mhz", "clock_sm_max_mhz", "clock_mem_max_mhz", "clock_video_max_mhz",
    "clocks_event_reasons"};

typedef struct {
    unsigned id, scope;
    int scoped;                    /* key was "id:scope" */
    nvmlReturn_t ret;              /* per-field nvmlReturn */
    int is_double;
    unsigned long long u;
    double d;
} field_t;

typedef struct { unsigned pid; unsigned long long mem; } proc_t;
typedef struct { unsigned pid, sm, mem, enc, dec; unsigned long long ts; } sample_t;

typedef struct {
    char uuid[NVML_DEVICE_UUID_V2_BUFFER_SIZE];
    char name[NVML_DEVICE_NAME_V2_BUFFER_SIZE];
    int has[N_SCALARS];
    unsigned long long v[N_SCALARS];   /* temperature_c is stored as a two's-complement cast */
    field_t *fields; int nfields;
    proc_t *procs; int nprocs;
    sample_t *samples; int nsamples;
} gpu_t;

typedef struct { char function[128]; int gpu; nvmlReturn_t code; } inject_t;
typedef struct { unsigned long long seq, type, data; unsigned gpu; } event_t;

typedef struct {
    char driver[NVML_SYSTEM_DRIVER_VERSION_BUFFER_SIZE];
    unsigned count;                    /* visible device count (<= ngpus) */
    nvmlReturn_t init_error;
    gpu_t *gpus; unsigned ngpus;
    inject_t *errs; int nerrs;
    event_t *events; int nevents;
} state_t;

struct nvmlDevice_st { unsigned index; };
struct nvmlEventSet_st {
    unsigned magic;
    unsigned long long mask[MAX_GPUS];
    struct nvmlEventSet_st *next;
};

static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
static state_t g_state;
static int g_loaded;                   /* g_state holds a successfully parsed file */
static int g_stamp_valid;
static struct stat g_stamp;
static char g_stamp_path[4096];
static unsigned g_refcount;
static struct nvmlDevice_st g_devs[MAX_GPUS];
static struct nvmlEventSet_st *g_sets;
static unsigned long long *g_consumed; /* seq numbers of events already delivered */
static size_t g_nconsumed, g_capconsumed;
static char g_last_complaint[512];

static void *xcalloc(size_t n, size_t size)
{
    void *p = calloc(n, size);
    if (!p) { fprintf(stderr, "nvml-standin: out of memory\n"); abort(); }
    return p;
}

static void complain(const char *fmt, const char *a, const char *b)
{
    char msg[sizeof g_last_complaint];
    snprintf(msg, sizeof msg, fmt, a, b);
    if (strcmp(msg, g_last_complaint) == 0) return;   /* do not repeat the same line on every call */
    snprintf(g_last_complaint, sizeof g_last_complaint, "%s", msg);
    fprintf(stderr, "nvml-standin: %s\n", msg);
}

static void free_state(state_t *s)
{
    for (unsigned i = 0; i < s->ngpus; i++) {
        free(s->gpus[i].fields);
        free(s->gpus[i].procs);
        free(s->gpus[i].samples);
    }
    free(s->gpus);
    free(s->errs);
    free(s->events);
    memset(s, 0, sizeof *s);
}

/* -- typed accessors on the DOM; each returns an error message or NULL -- */
static int jcount(const jparser *P, int node)
{
    int n = 0;
    for (int c = P->n[node].first; c >= 0; c = P->n[c].next) n++;
    return n;
}

static const char *get_ull(const jnode *n, unsigned long long *out)
{
    if (n->type != J_NUM || !n->is_int || (n->neg && n->u)) return "expected a non-negative integer";
    *out = n->u;
    return NULL;
}

static const char *get_uint(const jnode *n, unsigned *out)
{
    unsigned long long v;
    const char *e = get_ull(n, &v);
    if (e) return e;
    if (v > 0xFFFFFFFFull) return "integer does not fit 32 bits";
    *out = (unsigned)v;
    return NULL;
}

static const char *get_str(const jnode *n, char *out, size_t size)
{
    if (n->type != J_STR) return "expected a string";
    if (strlen(n->s) >= size) return "string too long";
    strcpy(out, n->s);
    return NULL;
}

static const char *load_field(const jparser *P, const jnode *n, field_t *f)
{
    char *end;
    errno = 0;
    unsigned long id = strtoul(n->key, &end, 10);
    if (end == n->key || errno || id > 0xFFFFFFFFul) return "field key must be \"<id>\" or \"<id>:<scope>\"";
    f->id = (unsigned)id;
    if (*end == ':') {
        char *s = end + 1;
        unsigned long scope = strtoul(s, &end, 10);
        if (end == s || scope > 0xFFFFFFFFul) return "bad field scope";
        f->scope = (unsigned)scope;
        f->scoped = 1;
    }
    if (*end) return "field key must be \"<id>\" or \"<id>:<scope>\"";
    f->ret = NVML_SUCCESS;
    if (n->type == J_OBJ) {            /* {"error": code} */
        int c = n->first;
        unsigned code;
        if (c < 0 || P->n[c].next >= 0 || strcmp(P->n[c].key, "error") != 0) return "field object must be {\"error\": code}";
        const char *e = get_uint(&P->n[c], &code);
        if (e) return e;
        f->ret = (nvmlReturn_t)code;
        return NULL;
    }
    if (n->type != J_NUM || n->neg) return "field value must be a non-negative number or {\"error\": code}";
    f->is_double = !n->is_int;
    f->u = n->u;
    f->d = n->d;
    return NULL;
}

static const char *load_gpu(const jparser *P, int node, gpu_t *g, const char **where)
{
    const char *e = NULL;
    if (P->n[node].type != J_OBJ) return "gpu entry must be an object";
    for (int c = P->n[node].first; c >= 0 && !e; c = P->n[c].next) {
        const jnode *n = &P->n[c];
        *where = n->key;
        if (!strcmp(n->key, "uuid")) { e = get_str(n, g->uuid, sizeof g->uuid); continue; }
        if (!strcmp(n->key, "name")) { e = get_str(n, g->name, sizeof g->name); continue; }
        int k;
        for (k = 0; k < N_SCALARS && strcmp(n->key, scalar_names[k]); k++) {}
        if (k < N_SCALARS) {
            if (n->type == J_NULL) continue;                /* null: NOT_SUPPORTED */
            if (k == S_TEMP && n->type == J_NUM && n->is_int && n->neg)
                g->v[k] = (unsigned long long)(-(long long)n->u);
            else if ((e = get_ull(n, &g->v[k]))) continue;
            g->has[k] = 1;
        } else if (!strcmp(n->key, "fields")) {
            if (n->type != J_OBJ) { e = "fields must be an object"; continue; }
            g->fields = xcalloc((size_t)jcount(P, c) + 1, sizeof *g->fields);
            for (int f = n->first; f >= 0 && !e; f = P->n[f].next)
                e = load_field(P, &P->n[f], &g->fields[g->nfields++]);
        } else if (!strcmp(n->key, "processes")) {
            if (n->type != J_ARR) { e = "processes must be an array"; continue; }
            g->procs = xcalloc((size_t)jcount(P, c) + 1, sizeof *g->procs);
            for (int p = n->first; p >= 0 && !e; p = P->n[p].next) {
                proc_t *pr = &g->procs[g->nprocs++];
                pr->mem = (unsigned long long)NVML_VALUE_NOT_AVAILABLE;
                if (P->n[p].type != J_OBJ) { e = "process entry must be an object"; break; }
                for (int m = P->n[p].first; m >= 0 && !e; m = P->n[m].next) {
                    const jnode *x = &P->n[m];
                    if (!strcmp(x->key, "pid")) e = get_uint(x, &pr->pid);
                    else if (!strcmp(x->key, "used_memory")) { if (x->type != J_NULL) e = get_ull(x, &pr->mem); }
                    else e = "unknown process key";
                }
            }
        } else if (!strcmp(n->key, "process_samples")) {
            if (n->type != J_ARR) { e = "process_samples must be an array"; continue; }
            g->samples = xcalloc((size_t)jcount(P, c) + 1, sizeof *g->samples);
            for (int p = n->first; p >= 0 && !e; p = P->n[p].next) {
                sample_t *s = &g->samples[g->nsamples++];
                if (P->n[p].type != J_OBJ) { e = "sample entry must be an object"; break; }
                for (int m = P->n[p].first; m >= 0 && !e; m = P->n[m].next) {
                    const jnode *x = &P->n[m];
                    if (!strcmp(x->key, "pid")) e = get_uint(x, &s->pid);
                    else if (!strcmp(x->key, "sm_util")) e = get_uint(x, &s->sm);
                    else if (!strcmp(x->key, "mem_util")) e = get_uint(x, &s->mem);
                    else if (!strcmp(x->key, "enc_util")) e = get_uint(x, &s->enc);
                    else if (!strcmp(x->key, "dec_util")) e = get_uint(x, &s->dec);
                    else if (!strcmp(x->key, "timestamp_us")) e = get_ull(x, &s->ts);
                    else e = "unknown process_samples key";
                }
            }
        } else {
            e = "unknown gpu key";
        }
    }
    return e;
}

static const char *load_state(const jparser *P, int root, state_t *s, const char **where)
{
    const char *e = NULL;
    int has_count = 0;
    if (P->n[root].type != J_OBJ) return "top level must be an object";
    snprintf(s->driver, sizeof s->driver, "%s", "0.0.0");
    for (int c = P->n[root].first; c >= 0 && !e; c = P->n[c].next) {
        const jnode *n = &P->n[c];
        *where = n->key;
        if (!strcmp(n->key, "version")) {
            unsigned v;
            if (!(e = get_uint(n, &v)) && v != 1) e = "unsupported state version (want 1)";
        } else if (!strcmp(n->key, "driver_version")) {
            e = get_str(n, s->driver, sizeof s->driver);
        } else if (!strcmp(n->key, "init_error")) {
            unsigned v = 0;
            e = get_uint(n, &v);
            s->init_error = (nvmlReturn_t)v;
        } else if (!strcmp(n->key, "device_count")) {
            if (n->type != J_NULL) { e = get_uint(n, &s->count); has_count = 1; }
        } else if (!strcmp(n->key, "gpus")) {
            if (n->type != J_ARR) { e = "gpus must be an array"; continue; }
            int count = jcount(P, c);
            if (count > MAX_GPUS) { e = "too many gpus"; continue; }
            s->gpus = xcalloc((size_t)count + 1, sizeof *s->gpus);
            for (int g = n->first; g >= 0 && !e; g = P->n[g].next)
                e = load_gpu(P, g, &s->gpus[s->ngpus++], where);
        } else if (!strcmp(n->key, "errors")) {
            if (n->type != J_ARR) { e = "errors must be an array"; continue; }
            s->errs = xcalloc((size_t)jcount(P, c) + 1, sizeof *s->errs);
            for (int x = n->first; x >= 0 && !e; x = P->n[x].next) {
                inject_t *in = &s->errs[s->nerrs++];
                unsigned code = 0;
                in->gpu = -1;
                if (P->n[x].type != J_OBJ) { e = "errors entry must be an object"; break; }
                for (int m = P->n[x].first; m >= 0 && !e; m = P->n[m].next) {
                    const jnode *y = &P->n[m];
                    unsigned gpu;
                    if (!strcmp(y->key, "function")) e = get_str(y, in->function, sizeof in->function);
                    else if (!strcmp(y->key, "code")) { e = get_uint(y, &code); in->code = (nvmlReturn_t)code; }
                    else if (!strcmp(y->key, "gpu")) { if (y->type != J_NULL && !(e = get_uint(y, &gpu))) in->gpu = (int)gpu; }
                    else e = "unknown errors key";
                }
                if (!e && (!in->function[0] || !code)) e = "errors entry needs function and a non-zero code";
            }
        } else if (!strcmp(n->key, "events")) {
            if (n->type != J_ARR) { e = "events must be an array"; continue; }
            s->events = xcalloc((size_t)jcount(P, c) + 1, sizeof *s->events);
            for (int x = n->first; x >= 0 && !e; x = P->n[x].next) {
                event_t *ev = &s->events[s->nevents++];
                if (P->n[x].type != J_OBJ) { e = "events entry must be an object"; break; }
                for (int m = P->n[x].first; m >= 0 && !e; m = P->n[m].next) {
                    const jnode *y = &P->n[m];
                    if (!strcmp(y->key, "seq")) e = get_ull(y, &ev->seq);
                    else if (!strcmp(y->key, "gpu")) e = get_uint(y, &ev->gpu);
                    else if (!strcmp(y->key, "type")) e = get_ull(y, &ev->type);
                    else if (!strcmp(y->key, "data")) e = get_ull(y, &ev->data);
                    else e = "unknown events key";
                }
            }
        } else {
            e = "unknown top-level key";
        }
    }
    if (!e && !has_count) s->count = s->ngpus;
    if (!e && s->count > s->ngpus) { *where = "device_count"; e = "device_count exceeds the number of gpus"; }
    return e;
}

/* Re-reads the state file if it changed.  Called with g_lock held. */
static nvmlReturn_t refresh(void)
{
    const char *path = getenv("NVML_STANDIN_STATE");
    struct stat st;
    if (!path || !*path) {
        complain("%s%sNVML_STANDIN_STATE is not set: behaving as if no driver were loaded", "", "");
        return NVML_ERROR_DRIVER_NOT_LOADED;
    }
    if (stat(path, &st) != 0) {
        complain("cannot stat state file %s: %s", path, strerror(errno));
        return NVML_ERROR_UNKNOWN;
    }
    if (g_stamp_valid && strcmp(path, g_stamp_path) == 0 && st.st_dev == g_stamp.st_dev &&
        st.st_ino == g_stamp.st_ino && st.st_size == g_stamp.st_size &&
        st.st_mtim.tv_sec == g_stamp.st_mtim.tv_sec && st.st_mtim.tv_nsec == g_stamp.st_mtim.tv_nsec &&
        st.st_ctim.tv_sec == g_stamp.st_ctim.tv_sec && st.st_ctim.tv_nsec == g_stamp.st_ctim.tv_nsec)
        return g_loaded ? NVML_SUCCESS : NVML_ERROR_UNKNOWN;

    FILE *f = fopen(path, "rb");
    if (!f || fstat(fileno(f), &st) != 0) {
        complain("cannot open state file %s: %s", path, strerror(errno));
        if (f) fclose(f);
        return NVML_ERROR_UNKNOWN;
    }
    g_stamp = st;                      /* stamp of the file actually read */
    g_stamp_valid = 1;
    snprintf(g_stamp_path, sizeof g_stamp_path, "%s", path);
    g_loaded = 0;

    char *buf = malloc((size_t)st.st_size + 1);
    size_t got = buf ? fread(buf, 1, (size_t)st.st_size, f) : 0;
    fclose(f);
    if (!buf || got != (size_t)st.st_size) {
        free(buf);
        complain("short read on state file %s%s", path, "");
        return NVML_ERROR_UNKNOWN;
    }
    buf[got] = '\0';

    jparser P = {buf, buf + got, NULL, 0, 0, NULL};
    const char *where = "(document)";
    int root = jvalue(&P, 0);
    if (root >= 0) { jws(&P); if (P.p != P.end) P.err = "trailing characters"; }
    state_t next;
    memset(&next, 0, sizeof next);
    const char *err = P.err ? P.err : load_state(&P, root, &next, &where);
    if (err) {
        char ctx[300];
        snprintf(ctx, sizeof ctx, "%s (at key \"%s\")", err, where);
        complain("bad state file %s: %s", path, ctx);
        free_state(&next);
    } else {
        free_state(&g_state);
        g_state = next;
        g_loaded = 1;
        g_last_complaint[0] = '\0';
    }
    free(P.n);
    free(buf);
    return g_loaded ? NVML_SUCCESS : NVML_ERROR_UNKNOWN;
}

/* ===================================================================== call plumbing === */
static nvmlReturn_t injected(const char *fn, int gpu)
{
    for (int i = 0; i < g_state.nerrs; i++) {
        const inject_t *e = &g_state.errs[i];
        if ((strcmp(e->function, fn) == 0 || strcmp(e->function, "*") == 0) && (e->gpu < 0 || e->gpu == gpu))
            return e->code;
    }
    return NVML_SUCCESS;
}

static nvmlReturn_t leave(nvmlReturn_t r)
{
    pthread_mutex_unlock(&g_lock);
    return r;
}

/* Locks, refreshes, checks init and injected errors.  On NVML_SUCCESS the lock is still held. */
static nvmlReturn_t enter(const char *fn, int gpu)
{
    pthread_mutex_lock(&g_lock);
    nvmlReturn_t r = refresh();
    if (r == NVML_SUCCESS && g_refcount == 0) r = NVML_ERROR_UNINITIALIZED;
    if (r == NVML_SUCCESS) r = injected(fn, gpu);
    return r == NVML_SUCCESS ? r : leave(r);
}

static int handle_index(nvmlDevice_t d)
{
    if (d < g_devs || d >= g_devs + MAX_GPUS) return -1;
    return (int)(d - g_devs);
}

static nvmlReturn_t enter_dev(const char *fn, nvmlDevice_t d, const gpu_t **g)
{
    pthread_mutex_lock(&g_lock);
    nvmlReturn_t r = refresh();
    int idx = handle_index(d);
    if (r == NVML_SUCCESS && g_refcount == 0) r = NVML_ERROR_UNINITIALIZED;
    if (r == NVML_SUCCESS && idx < 0) r = NVML_ERROR_INVALID_ARGUMENT;
    if (r == NVML_SUCCESS) r = injected(fn, idx);
    if (r == NVML_SUCCESS && (unsigned)idx >= g_state.count) r = NVML_ERROR_GPU_IS_LOST;
    if (r != NVML_SUCCESS) return leave(r);
    *g = &g_state.gpus[idx];
    return NVML_SUCCESS;
}

static nvmlReturn_t get_scalar(const char *fn, nvmlDevice_t d, int which, unsigned long long *out)
{
    const gpu_t *g;
    nvmlReturn_t r = enter_dev(fn, d, &g);
    if (r != NVML_SUCCESS) return r;
    if (!g->has[which]) return leave(NVML_ERROR_NOT_SUPPORTED);
    *out = g->v[which];
    return leave(NVML_SUCCESS);
}

static nvmlReturn_t get_uint_scalar(const char *fn, nvmlDevice_t d, int which, unsigned int *out)
{
    unsigned long long v;
    nvmlReturn_t r = get_scalar(fn, d, which, &v);
    if (r == NVML_SUCCESS) {
        if (!out) return NVML_ERROR_INVALID_ARGUMENT;
        *out = (unsigned int)v;
    }
    return r;
}

static nvmlReturn_t copy_string(const char *src, char *dst, unsigned int length)
{
    if (!dst) return NVML_ERROR_INVALID_ARGUMENT;
    if (strlen(src) + 1 > length) return NVML_ERROR_INSUFFICIENT_SIZE;
    strcpy(dst, src);
    return NVML_SUCCESS;
}

static unsigned long long now_us(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (unsigned long long)ts.tv_sec * 1000000ull + (unsigned long long)ts.tv_nsec / 1000ull;
}

/* ================================================================ init and system === */
/* init is reference counted like the real library: every successful init needs a shutdown */
static nvmlReturn_t init(const char *fn)
{
    pthread_mutex_lock(&g_lock);
    nvmlReturn_t r = refresh();
    if (r == NVML_SUCCESS) r = g_state.init_error;
    if (r == NVML_SUCCESS) r = injected(fn, -1);
    if (r == NVML_SUCCESS) g_refcount++;
    return leave(r);
}

nvmlReturn_t nvmlInitWithFlags(unsigned int flags)
{
    (void)flags;   /* NO_GPUS / NO_ATTACH make no difference here */
    return init(__func__);
}

nvmlReturn_t nvmlInit_v2(void)
{
    return init(__func__);
}

nvmlReturn_t nvmlShutdown(void)
{
    nvmlReturn_t r = enter(__func__, -1);
    if (r != NVML_SUCCESS) return r;
    g_refcount--;
    return leave(NVML_SUCCESS);
}

const char *nvmlErrorString(nvmlReturn_t result)
{
    switch (result) {
    case NVML_SUCCESS: return "Success";
    case NVML_ERROR_UNINITIALIZED: return "Uninitialized";
    case NVML_ERROR_INVALID_ARGUMENT: return "Invalid Argument";
    case NVML_ERROR_NOT_SUPPORTED: return "Not Supported";
    case NVML_ERROR_NO_PERMISSION: return "Insufficient Permissions";
    case NVML_ERROR_ALREADY_INITIALIZED: return "Already Initialized";
    case NVML_ERROR_NOT_FOUND: return "Not Found";
    case NVML_ERROR_INSUFFICIENT_SIZE: return "Insufficient Size";
    case NVML_ERROR_INSUFFICIENT_POWER: return "Insufficient External Power";
    case NVML_ERROR_DRIVER_NOT_LOADED: return "Driver Not Loaded";
    case NVML_ERROR_TIMEOUT: return "Timeout";
    case NVML_ERROR_IRQ_ISSUE: return "Interrupt Request Issue";
    case NVML_ERROR_LIBRARY_NOT_FOUND: return "NVML Shared Library Not Found";
    case NVML_ERROR_FUNCTION_NOT_FOUND: return "Function Not Found";
    case NVML_ERROR_CORRUPTED_INFOROM: return "Corrupted infoROM";
    case NVML_ERROR_GPU_IS_LOST: return "GPU is lost";
    case NVML_ERROR_RESET_REQUIRED: return "GPU requires restart";
    case NVML_ERROR_OPERATING_SYSTEM: return "The operating system has blocked the request.";
    case NVML_ERROR_LIB_RM_VERSION_MISMATCH: return "RM has detected an NVML/RM version mismatch.";
    case NVML_ERROR_IN_USE: return "In use by another client";
    case NVML_ERROR_MEMORY: return "Insufficient Memory";
    case NVML_ERROR_NO_DATA: return "No data";
    case NVML_ERROR_VGPU_ECC_NOT_SUPPORTED: return "The requested vgpu operation is not available on target device, because ECC is enabled";
    case NVML_ERROR_INSUFFICIENT_RESOURCES: return "Ran out of critical resources, other than memory";
    case NVML_ERROR_FREQ_NOT_SUPPORTED: return "Frequency not supported";
    case NVML_ERROR_ARGUMENT_VERSION_MISMATCH: return "Argument version mismatch";
    case NVML_ERROR_DEPRECATED: return "Deprecated";
    case NVML_ERROR_NOT_READY: return "Not ready";
    case NVML_ERROR_GPU_NOT_FOUND: return "GPU not found";
    case NVML_ERROR_INVALID_STATE: return "Invalid state";
    case NVML_ERROR_RESET_TYPE_NOT_SUPPORTED: return "Reset type not supported";
    default: return "Unknown Error";
    }
}

nvmlReturn_t nvmlSystemGetDriverVersion(char *version, unsigned int length)
{
    nvmlReturn_t r = enter(__func__, -1);
    if (r != NVML_SUCCESS) return r;
    return leave(copy_string(g_state.driver, version, length));
}

nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *deviceCount)
{
    nvmlReturn_t r = enter(__func__, -1);
    if (r != NVML_SUCCESS) return r;
    if (!deviceCount) return leave(NVML_ERROR_INVALID_ARGUMENT);
    *deviceCount = g_state.count;
    return leave(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *device)
{
    nvmlReturn_t r = enter(__func__, index < MAX_GPUS ? (int)index : -2);
    if (r != NVML_SUCCESS) return r;
    if (!device || index >= g_state.count) return leave(NVML_ERROR_INVALID_ARGUMENT);
    g_devs[index].index = index;
    *device = &g_devs[index];
    return leave(NVML_SUCCESS);
}

/* ======================================================================== device queries === */
nvmlReturn_t nvmlDeviceGetIndex(nvmlDevice_t device, unsigned int *index)
{
    const gpu_t *g;
    nvmlReturn_t r = enter_dev(__func__, device, &g);
    if (r != NVML_SUCCESS) return r;
    if (!index) return leave(NVML_ERROR_INVALID_ARGUMENT);
    *index = (unsigned)(g - g_state.gpus);
    return leave(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t device, char *uuid, unsigned int length)
{
    const gpu_t *g;
    nvmlReturn_t r = enter_dev(__func__, device, &g);
    if (r != NVML_SUCCESS) return r;
    return leave(g->uuid[0] ? copy_string(g->uuid, uuid, length) : NVML_ERROR_NOT_SUPPORTED);
}

nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t device, char *name, unsigned int length)
{
    const gpu_t *g;
    nvmlReturn_t r = enter_dev(__func__, device, &g);
    if (r != NVML_SUCCESS) return r;
    return leave(g->name[0] ? copy_string(g->name, name, length) : NVML_ERROR_NOT_SUPPORTED);
}

nvmlReturn_t nvmlDeviceGetUtilizationRates(nvmlDevice_t device, nvmlUtilization_t *utilization)
{
    const gpu_t *g;
    nvmlReturn_t r = enter_dev(__func__, device, &g);
    if (r != NVML_SUCCESS) return r;
    if (!utilization) return leave(NVML_ERROR_INVALID_ARGUMENT);
    if (!g->has[S_UTIL_GPU] || !g->has[S_UTIL_MEM]) return leave(NVML_ERROR_NOT_SUPPORTED);
    utilization->gpu = (unsigned)g->v[S_UTIL_GPU];
    utilization->memory = (unsigned)g->v[S_UTIL_MEM];
    return leave(NVML_SUCCESS);
}

/* total = free + used + reserved; v1 reports reserved as part of used (see nvml.h). */
static nvmlReturn_t memory(const char *fn, nvmlDevice_t device, unsigned long long out[4])
{
    const gpu_t *g;
    nvmlReturn_t r = enter_dev(fn, device, &g);
    if (r != NVML_SUCCESS) return r;
    if (!g->has[S_MEM_TOTAL] || !g->has[S_MEM_USED]) return leave(NVML_ERROR_NOT_SUPPORTED);
    unsigned long long total = g->v[S_MEM_TOTAL], used = g->v[S_MEM_USED];
    unsigned long long reserved = g->has[S_MEM_RESERVED] ? g->v[S_MEM_RESERVED] : 0;
    out[0] = total;
    out[1] = reserved;
    out[2] = used + reserved >= total ? 0 : total - used - reserved;
    out[3] = used;
    return leave(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t device, nvmlMemory_t *mem)
{
    unsigned long long v[4];
    nvmlReturn_t r = memory(__func__, device, v);
    if (r != NVML_SUCCESS) return r;
    if (!mem) return NVML_ERROR_INVALID_ARGUMENT;
    mem->total = v[0];
    mem->free = v[2];
    mem->used = v[3] + v[1];
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t device, nvmlMemory_v2_t *mem)
{
    unsigned long long v[4];
    nvmlReturn_t r = memory(__func__, device, v);
    if (r != NVML_SUCCESS) return r;
    if (!mem) return NVML_ERROR_INVALID_ARGUMENT;
    if (mem->version != nvmlMemory_v2) return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    mem->total = v[0];
    mem->reserved = v[1];
    mem->free = v[2];
    mem->used = v[3];
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetPowerUsage(nvmlDevice_t device, unsigned int *power)
{
    return get_uint_scalar(__func__, device, S_POWER, power);
}

nvmlReturn_t nvmlDeviceGetEnforcedPowerLimit(nvmlDevice_t device, unsigned int *limit)
{
    return get_uint_scalar(__func__, device, S_POWER_LIMIT, limit);
}

/* Current and maximum are independent keys: a test sets an idle GPU's downshifted current link apart from
 * the maximum the GPU and its slot support, as nvidia-smi shows them. */
nvmlReturn_t nvmlDeviceGetCurrPcieLinkGeneration(nvmlDevice_t device, unsigned int *currLinkGen)
{
    return get_uint_scalar(__func__, device, S_PCIE_GEN_CUR, currLinkGen);
}

nvmlReturn_t nvmlDeviceGetMaxPcieLinkGeneration(nvmlDevice_t device, unsigned int *maxLinkGen)
{
    return get_uint_scalar(__func__, device, S_PCIE_GEN_MAX, maxLinkGen);
}

nvmlReturn_t nvmlDeviceGetCurrPcieLinkWidth(nvmlDevice_t device, unsigned int *currLinkWidth)
{
    return get_uint_scalar(__func__, device, S_PCIE_WIDTH_CUR, currLinkWidth);
}

nvmlReturn_t nvmlDeviceGetMaxPcieLinkWidth(nvmlDevice_t device, unsigned int *maxLinkWidth)
{
    return get_uint_scalar(__func__, device, S_PCIE_WIDTH_MAX, maxLinkWidth);
}

nvmlReturn_t nvmlDeviceGetTemperature(nvmlDevice_t device, nvmlTemperatureSensors_t sensorType, unsigned int *temp)
{
    unsigned long long v;
    nvmlReturn_t r = get_scalar(__func__, device, S_TEMP, &v);
    if (r != NVML_SUCCESS) return r;
    if (!temp || sensorType >= NVML_TEMPERATURE_COUNT) return NVML_ERROR_INVALID_ARGUMENT;
    if (sensorType != NVML_TEMPERATURE_GPU) return NVML_ERROR_NOT_SUPPORTED;
    *temp = (long long)v < 0 ? 0u : (unsigned int)v;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetTemperatureV(nvmlDevice_t device, nvmlTemperature_t *temperature)
{
    unsigned long long v;
    nvmlReturn_t r = get_scalar(__func__, device, S_TEMP, &v);
    if (r != NVML_SUCCESS) return r;
    if (!temperature || temperature->sensorType >= NVML_TEMPERATURE_COUNT) return NVML_ERROR_INVALID_ARGUMENT;
    if (temperature->version != nvmlTemperature_v1) return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    if (temperature->sensorType != NVML_TEMPERATURE_GPU) return NVML_ERROR_NOT_SUPPORTED;
    temperature->temperature = (int)(long long)v;
    return NVML_SUCCESS;
}

/* which[]: the scalar of each nvmlClockType_t (graphics, SM, memory, video), current or maximum. */
static nvmlReturn_t clock_info(const char *fn, nvmlDevice_t device, nvmlClockType_t type, unsigned int *clock,
                               const int which[NVML_CLOCK_COUNT])
{
    const gpu_t *g;
    nvmlReturn_t r = enter_dev(fn, device, &g);
    if (r != NVML_SUCCESS) return r;
    if (!clock || (unsigned)type >= NVML_CLOCK_COUNT) return leave(NVML_ERROR_INVALID_ARGUMENT);
    if (!g->has[which[type]]) return leave(NVML_ERROR_NOT_SUPPORTED);
    *clock = (unsigned int)g->v[which[type]];
    return leave(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetClockInfo(nvmlDevice_t device, nvmlClockType_t type, unsigned int *clock)
{
    static const int which[NVML_CLOCK_COUNT] = {S_CLK_GRAPHICS, S_CLK_SM, S_CLK_MEM, S_CLK_VIDEO};
    return clock_info(__func__, device, type, clock, which);
}

/* The maximum a clock can reach (the boost clock), independent of the current one: a throttled GPU's
 * clock_sm_mhz sits below clock_sm_max_mhz. */
nvmlReturn_t nvmlDeviceGetMaxClockInfo(nvmlDevice_t device, nvmlClockType_t type, unsigned int *clock)
{
    static const int which[NVML_CLOCK_COUNT] = {S_CLK_GRAPHICS_MAX, S_CLK_SM_MAX, S_CLK_MEM_MAX, S_CLK_VIDEO_MAX};
    return clock_info(__func__, device, type, clock, which);
}

/* Both names answer the same bitmask (nvmlClocksEventReason* = nvmlClocksThrottleReason*); the older one is
 * deprecated in NVML 13 but still exported, and an agent falls back to it on drivers without the newer. */
static nvmlReturn_t clocks_event_reasons(const char *fn, nvmlDevice_t device, unsigned long long *reasons)
{
    unsigned long long v;
    nvmlReturn_t r = get_scalar(fn, device, S_CLOCKS_EVENT_REASONS, &v);
    if (r == NVML_SUCCESS) {
        if (!reasons) return NVML_ERROR_INVALID_ARGUMENT;
        *reasons = v;
    }
    return r;
}

nvmlReturn_t nvmlDeviceGetCurrentClocksEventReasons(nvmlDevice_t device, unsigned long long *clocksEventReasons)
{
    return clocks_event_reasons(__func__, device, clocksEventReasons);
}

nvmlReturn_t nvmlDeviceGetCurrentClocksThrottleReasons(nvmlDevice_t device, unsigned long long *clocksThrottleReasons)
{
    return clocks_event_reasons(__func__, device, clocksThrottleReasons);
}

nvmlReturn_t nvmlDeviceGetFieldValues(nvmlDevice_t device, int valuesCount, nvmlFieldValue_t *values)
{
    const gpu_t *g;
    nvmlReturn_t r = enter_dev(__func__, device, &g);
    if (r != NVML_SUCCESS) return r;
    if (valuesCount < 0 || (valuesCount > 0 && !values)) return leave(NVML_ERROR_INVALID_ARGUMENT);
    long long ts = (long long)now_us();
    for (int i = 0; i < valuesCount; i++) {
        nvmlFieldValue_t *v = &values[i];
        const field_t *f = NULL;
        for (int k = 0; k < g->nfields && !f; k++)   /* an "id:scope" entry wins over a plain "id" */
            if (g->fields[k].id == v->fieldId && g->fields[k].scoped && g->fields[k].scope == v->scopeId)
                f = &g->fields[k];
        for (int k = 0; k < g->nfields && !f; k++)
            if (g->fields[k].id == v->fieldId && !g->fields[k].scoped) f = &g->fields[k];
        v->timestamp = ts;
        v->latencyUsec = 0;
        v->valueType = NVML_VALUE_TYPE_UNSIGNED_LONG_LONG;
        v->value.ullVal = 0;
        v->nvmlReturn = f ? f->ret : NVML_ERROR_NOT_SUPPORTED;
        if (!f || f->ret != NVML_SUCCESS) continue;
        if (f->is_double) { v->valueType = NVML_VALUE_TYPE_DOUBLE; v->value.dVal = f->d; }
        else v->value.ullVal = f->u;
    }
    return leave(NVML_SUCCESS);
}

/* The same counter as field NVML_FI_DEV_PCIE_REPLAY_COUNTER (its plain "<id>" entry in "fields"), so a test
 * sets it once; an {"error": code} entry is returned as the call's result. */
nvmlReturn_t nvmlDeviceGetPcieReplayCounter(nvmlDevice_t device, unsigned int *value)
{
    const gpu_t *g;
    nvmlReturn_t r = enter_dev(__func__, device, &g);
    if (r != NVML_SUCCESS) return r;
    if (!value) return leave(NVML_ERROR_INVALID_ARGUMENT);
    for (int k = 0; k < g->nfields; k++) {
        const field_t *f = &g->fields[k];
        if (f->id != NVML_FI_DEV_PCIE_REPLAY_COUNTER || f->scoped) continue;
        if (f->ret != NVML_SUCCESS) return leave(f->ret);
        *value = f->is_double ? (unsigned int)f->d : (unsigned int)f->u;
        return leave(NVML_SUCCESS);
    }
    return leave(NVML_ERROR_NOT_SUPPORTED);
}

nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v3(nvmlDevice_t device, unsigned int *infoCount, nvmlProcessInfo_t *infos)
{
    const gpu_t *g;
    nvmlReturn_t r = enter_dev(__func__, device, &g);
    if (r != NVML_SUCCESS) return r;
    if (!infoCount) return leave(NVML_ERROR_INVALID_ARGUMENT);
    unsigned n = (unsigned)g->nprocs;
    if (n == 0) { *infoCount = 0; return leave(NVML_SUCCESS); }
    if (!infos || *infoCount < n) { *infoCount = n; return leave(NVML_ERROR_INSUFFICIENT_SIZE); }
    for (unsigned i = 0; i < n; i++) {
        infos[i].pid = g->procs[i].pid;
        infos[i].usedGpuMemory = g->procs[i].mem;
        infos[i].gpuInstanceId = 0xFFFFFFFFu;
        infos[i].computeInstanceId = 0xFFFFFFFFu;
    }
    *infoCount = n;
    return leave(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetProcessUtilization(nvmlDevice_t device, nvmlProcessUtilizationSample_t *utilization,
                                             unsigned int *processSamplesCount, unsigned long long lastSeenTimeStamp)
{
    const gpu_t *g;
    nvmlReturn_t r = enter_dev(__func__, device, &g);
    if (r != NVML_SUCCESS) return r;
    if (!processSamplesCount) return leave(NVML_ERROR_INVALID_ARGUMENT);
    unsigned n = 0;
    for (int i = 0; i < g->nsamples; i++) n += g->samples[i].ts > lastSeenTimeStamp;
    if (n == 0) return leave(NVML_ERROR_NOT_FOUND);
    if (!utilization || *processSamplesCount < n) { *processSamplesCount = n; return leave(NVML_ERROR_INSUFFICIENT_SIZE); }
    unsigned k = 0;
    for (int i = 0; i < g->nsamples; i++) {
        const sample_t *s = &g->samples[i];
        if (s->ts <= lastSeenTimeStamp) continue;
        utilization[k].pid = s->pid;
        utilization[k].timeStamp = s->ts;
        utilization[k].smUtil = s->sm;
        utilization[k].memUtil = s->mem;
        utilization[k].encUtil = s->enc;
        utilization[k].decUtil = s->dec;
        k++;
    }
    *processSamplesCount = k;
    return leave(NVML_SUCCESS);
}

/* ================================================================================ events === */
static int set_valid(nvmlEventSet_t set)
{
    for (struct nvmlEventSet_st *s = g_sets; s; s = s->next)
        if (s == set) return s->magic == SET_MAGIC;
    return 0;
}

nvmlReturn_t nvmlDeviceGetSupportedEventTypes(nvmlDevice_t device, unsigned long long *eventTypes)
{
    unsigned long long v;
    nvmlReturn_t r = get_scalar(__func__, device, S_EVENT_TYPES, &v);
    if (r == NVML_SUCCESS) {
        if (!eventTypes) return NVML_ERROR_INVALID_ARGUMENT;
        *eventTypes = v;
    }
    return r;
}

nvmlReturn_t nvmlEventSetCreate(nvmlEventSet_t *set)
{
    nvmlReturn_t r = enter(__func__, -1);
    if (r != NVML_SUCCESS) return r;
    if (!set) return leave(NVML_ERROR_INVALID_ARGUMENT);
    struct nvmlEventSet_st *s = calloc(1, sizeof *s);
    if (!s) return leave(NVML_ERROR_MEMORY);
    s->magic = SET_MAGIC;
    s->next = g_sets;
    g_sets = s;
    *set = s;
    return leave(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceRegisterEvents(nvmlDevice_t device, unsigned long long eventTypes, nvmlEventSet_t set)
{
    const gpu_t *g;
    nvmlReturn_t r = enter_dev(__func__, device, &g);
    if (r != NVML_SUCCESS) return r;
    if (!set_valid(set)) return leave(NVML_ERROR_INVALID_ARGUMENT);
    if (!g->has[S_EVENT_TYPES] || (eventTypes & ~g->v[S_EVENT_TYPES])) return leave(NVML_ERROR_NOT_SUPPORTED);
    set->mask[g - g_state.gpus] |= eventTypes;
    return leave(NVML_SUCCESS);
}

static int consumed(unsigned long long seq)
{
    for (size_t i = 0; i < g_nconsumed; i++)
        if (g_consumed[i] == seq) return 1;
    return 0;
}

/* Queued events are delivered once per process, in file order, to the first waiting set that has
 * the event's GPU registered for its type; events for unregistered GPUs stay queued.  The state
 * file is polled every 5 ms with the lock released, so an event queued mid-wait is delivered. */
nvmlReturn_t nvmlEventSetWait_v2(nvmlEventSet_t set, nvmlEventData_t *data, unsigned int timeoutms)
{
    struct timespec t0, t;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (;;) {
        nvmlReturn_t r = enter(__func__, -1);
        if (r != NVML_SUCCESS) return r;
        if (!set_valid(set) || !data) return leave(NVML_ERROR_INVALID_ARGUMENT);
        for (unsigned gpu = 0; gpu < g_state.count; gpu++)
            if (set->mask[gpu] && (r = injected(__func__, (int)gpu)) != NVML_SUCCESS) return leave(r);
        for (int i = 0; i < g_state.nevents; i++) {
            const event_t *e = &g_state.events[i];
            if (e->gpu >= g_state.count || !(set->mask[e->gpu] & e->type) || consumed(e->seq)) continue;
            if (g_nconsumed == g_capconsumed) {
                size_t cap = g_capconsumed ? g_capconsumed * 2 : 32;
                unsigned long long *p = realloc(g_consumed, cap * sizeof *p);
                if (!p) return leave(NVML_ERROR_MEMORY);
                g_consumed = p;
                g_capconsumed = cap;
            }
            g_consumed[g_nconsumed++] = e->seq;
            g_devs[e->gpu].index = e->gpu;
            data->device = &g_devs[e->gpu];
            data->eventType = e->type;
            data->eventData = e->data;
            data->gpuInstanceId = 0xFFFFFFFFu;
            data->computeInstanceId = 0xFFFFFFFFu;
            return leave(NVML_SUCCESS);
        }
        leave(NVML_SUCCESS);
        clock_gettime(CLOCK_MONOTONIC, &t);
        long long elapsed_ms = (t.tv_sec - t0.tv_sec) * 1000LL + (t.tv_nsec - t0.tv_nsec) / 1000000LL;
        if (elapsed_ms >= (long long)timeoutms) return NVML_ERROR_TIMEOUT;
        long long nap = (long long)timeoutms - elapsed_ms < 5 ? (long long)timeoutms - elapsed_ms : 5;
        struct timespec ts = {0, (long)(nap * 1000000LL)};
        nanosleep(&ts, NULL);
    }
}

nvmlReturn_t nvmlEventSetFree(nvmlEventSet_t set)
{
    nvmlReturn_t r = enter(__func__, -1);
    if (r != NVML_SUCCESS) return r;
    for (struct nvmlEventSet_st **p = &g_sets; *p; p = &(*p)->next) {
        if (*p == set) {
            *p = set->next;
            set->magic = 0;
            free(set);
            return leave(NVML_SUCCESS);
        }
    }
    return leave(NVML_ERROR_INVALID_ARGUMENT);
}

/* ========================================================== test-only helper (not NVML) === */
void nvml_standin_reset(void);

/* Forgets init refcount, event sets, delivered events and the cached state: for in-process
 * tests that reuse one loaded library across test cases. */
void nvml_standin_reset(void)
{
    pthread_mutex_lock(&g_lock);
    while (g_sets) {
        struct nvmlEventSet_st *s = g_sets;
        g_sets = s->next;
        free(s);
    }
    free(g_consumed);
    g_consumed = NULL;
    g_nconsumed = g_capconsumed = 0;
    g_refcount = 0;
    free_state(&g_state);
    g_loaded = g_stamp_valid = 0;
    g_last_complaint[0] = '\0';
    pthread_mutex_unlock(&g_lock);
}
