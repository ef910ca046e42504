// The n-gram lookup of engine/spec/ngram.py in C++: LazyNgramIndex's rule (the latest earlier occurrence of the
// longest suffix of a request's tokens, between min_n and max_n long, and the tokens that followed it), for a whole
// batch in one call. A CPython extension module (no torch), built on first use by engine/kernels/python_module.py.
//
// Why native: the lookup runs for every decoding request every step; in Python it cost about as much per request
// as the rest of a plain decode step (ops/bench/README.md). Here a request's step costs its new tokens' hashes and
// one or two probes, and the batch crosses into C once.
//
// Per request (NgramIndex): its tokens, copied as they come from the request's prompt and output lists, and per n
// a hash table of the n-grams indexed so far (open addressing; a slot holds where the gram's latest occurrence ends,
// the key is the tokens there, so a table is 8 bytes a slot and a match is always exact). An n is indexed only once
// a lookup tries it, up to the tokens before the suffix, and the lengths are tried in LazyNgramIndex's order
// (longest, shortest, then bisection), so the same lengths get indexed.

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

namespace {

constexpr int kMaxN = 16;  // SpeculativeConfig.ngram_max's bound

struct GramTable {
    std::vector<uint32_t> ends;    // per slot: end (exclusive) of the gram's latest occurrence; 0: empty
    std::vector<uint32_t> hashes;  // per slot: the gram's hash (probing compares it before the tokens)
    size_t count = 0;
    uint32_t indexed_to = 0;  // grams ending at or before this are in
    bool made = false;        // a lookup tried this n (the table exists)
};

struct NgramIndexObject {
    PyObject_HEAD
    int min_n;
    int max_n;
    std::vector<uint32_t>* tokens;
    GramTable* tables;  // [max_n + 1]
    uint32_t missed_end;  // the suffixes of missed_n or more tokens of the first missed_end tokens never occurred
    int missed_n;
};

// Drawn once per process (PyInit): prompts are the users', and a hash they could predict would let a crafted one pile
// its grams into one run of slots (each insert probing the whole run). Python's own str hashes are seeded likewise.
uint64_t hash_seed = 0x9E3779B97F4A7C15ull;

inline uint32_t hash_gram(const uint32_t* gram, int n) {
    uint64_t h = hash_seed ^ static_cast<uint64_t>(n);
    for (int i = 0; i < n; ++i) {
        h ^= gram[i];
        h *= 0xBF58476D1CE4E5B9ull;
        h ^= h >> 31;
    }
    return static_cast<uint32_t>(h ^ (h >> 32));
}

// The slot of the gram `tokens[end - n, end)`: where it is stored, else the empty slot it would take.
inline size_t find_slot(const GramTable& table, const uint32_t* tokens, int n, uint32_t end, uint32_t hash) {
    const size_t mask = table.ends.size() - 1;
    const uint32_t* gram = tokens + end - n;
    for (size_t slot = hash & mask;; slot = (slot + 1) & mask) {
        const uint32_t stored = table.ends[slot];
        if (stored == 0) return slot;
        if (table.hashes[slot] == hash && std::memcmp(tokens + stored - n, gram, sizeof(uint32_t) * n) == 0) {
            return slot;
        }
    }
}

// Doubles the table's slots and re-places every gram by its hash (distinct grams: no tokens compared).
void grow(GramTable& table) {
    std::vector<uint32_t> ends(table.ends.size() * 2, 0), hashes(table.ends.size() * 2, 0);
    const size_t mask = ends.size() - 1;
    for (size_t i = 0; i < table.ends.size(); ++i) {
        if (table.ends[i] == 0) continue;
        size_t slot = table.hashes[i] & mask;
        while (ends[slot] != 0) slot = (slot + 1) & mask;
        ends[slot] = table.ends[i];
        hashes[slot] = table.hashes[i];
    }
    table.ends.swap(ends);
    table.hashes.swap(hashes);
}

// Where the latest earlier occurrence of the last n of the first `end` tokens ends (0: none); indexes the n-grams
// ending before `end` first.
uint32_t latest(NgramIndexObject* self, int n, uint32_t end) {
    GramTable& table = self->tables[n];
    const uint32_t* tokens = self->tokens->data();
    if (!table.made) {  // first use of this n: no gram yet (the first ends at n)
        table.ends.assign(64, 0);
        table.hashes.assign(64, 0);
        table.indexed_to = static_cast<uint32_t>(n - 1);
        table.made = true;
    }
    for (uint32_t stop = table.indexed_to + 1; stop + 1 <= end; ++stop) {  // grams ending at indexed_to+1 .. end-1
        if ((table.count + 1) * 2 > table.ends.size()) grow(table);
        const uint32_t hash = hash_gram(tokens + stop - n, n);
        const size_t slot = find_slot(table, tokens, n, stop, hash);
        if (table.ends[slot] == 0) {
            table.count += 1;
            table.hashes[slot] = hash;
        }
        table.ends[slot] = stop;  // the latest occurrence wins
    }
    if (table.indexed_to < end - 1) table.indexed_to = end - 1;  // end >= n >= 1: the caller's bound
    return table.ends[find_slot(table, tokens, n, end, hash_gram(tokens + end - n, n))];
}

// Appends list[start:] to the index's tokens; false (an exception set) if an item is not an integer in [0, 2**32).
// Any integer type is taken (a numpy id too, through __index__, which may run Python code: the list's size is read
// again for each item and the item held while it converts).
bool copy_tail(std::vector<uint32_t>& tokens, PyObject* list, Py_ssize_t start) {
    for (Py_ssize_t i = start; i < PyList_GET_SIZE(list); ++i) {
        PyObject* item = PyList_GET_ITEM(list, i);
        unsigned long value;
        if (PyLong_CheckExact(item)) {
            value = PyLong_AsUnsignedLong(item);
        } else {
            Py_INCREF(item);
            PyObject* index = PyNumber_Index(item);
            Py_DECREF(item);
            if (index == nullptr) return false;
            value = PyLong_AsUnsignedLong(index);
            Py_DECREF(index);
        }
        if (value == static_cast<unsigned long>(-1) && PyErr_Occurred()) return false;
        if (value > 0xFFFFFFFFul) {
            PyErr_Format(PyExc_OverflowError, "token id %lu does not fit 32 bits", value);
            return false;
        }
        tokens.push_back(static_cast<uint32_t>(value));
    }
    return true;
}

// LazyNgramIndex.propose: the draft as a new list (empty: none); nullptr with an exception set on bad input.
PyObject* propose(NgramIndexObject* self, PyObject* prompt, PyObject* output, Py_ssize_t num_tokens, int min_n) {
    if (!PyList_Check(prompt) || !PyList_Check(output)) {
        PyErr_SetString(PyExc_TypeError, "a request's prompt and output token ids must be lists");
        return nullptr;
    }
    std::vector<uint32_t>& tokens = *self->tokens;
    const Py_ssize_t num_prompt = PyList_GET_SIZE(prompt);
    Py_ssize_t num_copied = static_cast<Py_ssize_t>(tokens.size());
    if (num_copied < num_prompt) {
        if (!copy_tail(tokens, prompt, num_copied)) return nullptr;
        num_copied = num_prompt;
    }
    if (num_copied - num_prompt < PyList_GET_SIZE(output)) {
        if (!copy_tail(tokens, output, num_copied - num_prompt)) return nullptr;
    }
    if (tokens.size() > 0xFFFFFFFEul) {
        PyErr_SetString(PyExc_OverflowError, "a request of 2**32 tokens or more");
        return nullptr;
    }
    if (num_tokens <= 0 || tokens.empty()) return PyList_New(0);
    const uint32_t end = static_cast<uint32_t>(tokens.size());
    int longest = self->max_n < static_cast<int64_t>(end) ? self->max_n : static_cast<int>(end);
    const int shortest = min_n < self->min_n ? self->min_n : min_n;
    if (self->missed_end == end && self->missed_n <= longest) longest = self->missed_n - 1;
    if (longest < shortest) return PyList_New(0);
    // Whether a suffix occurred before falls with its length: the longest first, then the shortest, then bisection.
    uint32_t found = latest(self, longest, end);
    if (found == 0) {
        if (longest == shortest || (found = latest(self, shortest, end)) == 0) {
            self->missed_end = end;
            self->missed_n = shortest;
            return PyList_New(0);
        }
        int low = shortest, high = longest;  // the suffix of `low` tokens occurred before, of `high` did not
        while (high - low > 1) {
            const int middle = (low + high) / 2;
            const uint32_t found_middle = latest(self, middle, end);
            if (found_middle == 0) {
                high = middle;
            } else {
                low = middle;
                found = found_middle;
            }
        }
    }
    const Py_ssize_t count = std::min<Py_ssize_t>(num_tokens, static_cast<Py_ssize_t>(end - found));
    PyObject* draft = PyList_New(count);
    if (draft == nullptr) return nullptr;
    for (Py_ssize_t i = 0; i < count; ++i) {
        PyObject* token = PyLong_FromUnsignedLong(tokens[found + i]);
        if (token == nullptr) {
            Py_DECREF(draft);
            return nullptr;
        }
        PyList_SET_ITEM(draft, i, token);
    }
    return draft;
}

PyObject* index_new(PyTypeObject* type, PyObject* args, PyObject* kwargs) {
    static const char* keywords[] = {"min_n", "max_n", nullptr};
    int min_n = 0, max_n = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "ii", const_cast<char**>(keywords), &min_n, &max_n)) return nullptr;
    if (min_n < 1 || min_n > max_n || max_n > kMaxN) {
        PyErr_Format(PyExc_ValueError, "need 1 <= min_n <= max_n <= %d, got %d and %d", kMaxN, min_n, max_n);
        return nullptr;
    }
    auto* self = reinterpret_cast<NgramIndexObject*>(type->tp_alloc(type, 0));
    if (self == nullptr) return nullptr;
    self->min_n = min_n;
    self->max_n = max_n;
    self->missed_end = 0;
    self->missed_n = max_n + 1;
    try {
        self->tokens = new std::vector<uint32_t>();
        self->tables = new GramTable[max_n + 1];
    } catch (...) {
        Py_DECREF(self);
        return PyErr_NoMemory();
    }
    return reinterpret_cast<PyObject*>(self);
}

void index_dealloc(PyObject* object) {
    auto* self = reinterpret_cast<NgramIndexObject*>(object);
    delete self->tokens;
    delete[] self->tables;
    Py_TYPE(object)->tp_free(object);
}

PyObject* index_propose(PyObject* object, PyObject* args, PyObject* kwargs) {
    static const char* keywords[] = {"prompt", "output", "num_tokens", "min_n", nullptr};
    PyObject *prompt = nullptr, *output = nullptr, *min_n_object = Py_None;
    Py_ssize_t num_tokens = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOn|O", const_cast<char**>(keywords), &prompt, &output,
                                     &num_tokens, &min_n_object)) {
        return nullptr;
    }
    auto* self = reinterpret_cast<NgramIndexObject*>(object);
    int min_n = self->min_n;
    if (min_n_object != Py_None) {
        const long value = PyLong_AsLong(min_n_object);
        if (value == -1 && PyErr_Occurred()) return nullptr;
        min_n = value > kMaxN + 1 ? kMaxN + 1 : static_cast<int>(value);
    }
    try {
        return propose(self, prompt, output, num_tokens, min_n);
    } catch (const std::bad_alloc&) {
        return PyErr_NoMemory();
    }
}

PyMethodDef index_methods[] = {
    {"propose", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(index_propose)),
     METH_VARARGS | METH_KEYWORDS,
     "propose(prompt, output, num_tokens, min_n=None) -> list[int]: LazyNgramIndex.propose (engine/spec/ngram.py)"},
    {nullptr, nullptr, 0, nullptr},
};

PyTypeObject NgramIndexType = {
    PyVarObject_HEAD_INIT(nullptr, 0)
    "tokenmill_ngram_index.NgramIndex",  // tp_name
};

PyObject* string_prompt = nullptr;
PyObject* string_output = nullptr;
PyObject* string_request_id = nullptr;

// propose_batch(wanted, indexes, min_n): NgramProposer.propose for the batch. `wanted` holds (request, view,
// num_tokens) triples (the Proposer interface), `indexes` each request's NgramIndex; returns {request_id: draft} for
// the requests with a draft.
PyObject* propose_batch(PyObject*, PyObject* args) {
    PyObject *wanted = nullptr, *indexes = nullptr;
    int min_n = 0;
    if (!PyArg_ParseTuple(args, "O!O!i", &PyList_Type, &wanted, &PyList_Type, &indexes, &min_n)) return nullptr;
    const Py_ssize_t size = PyList_GET_SIZE(wanted);
    if (PyList_GET_SIZE(indexes) != size) {
        PyErr_SetString(PyExc_ValueError, "one index per wanted request");
        return nullptr;
    }
    PyObject* drafts = PyDict_New();
    if (drafts == nullptr) return nullptr;
    for (Py_ssize_t i = 0; i < size; ++i) {
        PyObject* item = PyList_GET_ITEM(wanted, i);
        PyObject* index = PyList_GET_ITEM(indexes, i);
        if (!PyTuple_Check(item) || PyTuple_GET_SIZE(item) != 3 || Py_TYPE(index) != &NgramIndexType) {
            PyErr_SetString(PyExc_TypeError, "wanted: (request, tokens, num_tokens) triples; indexes: NgramIndex");
            Py_DECREF(drafts);
            return nullptr;
        }
        PyObject* request = PyTuple_GET_ITEM(item, 0);
        const Py_ssize_t num_tokens = PyLong_AsSsize_t(PyTuple_GET_ITEM(item, 2));
        if (num_tokens == -1 && PyErr_Occurred()) {
            Py_DECREF(drafts);
            return nullptr;
        }
        PyObject* prompt = PyObject_GetAttr(request, string_prompt);
        PyObject* output = prompt == nullptr ? nullptr : PyObject_GetAttr(request, string_output);
        PyObject* draft = nullptr;
        if (output != nullptr) {
            try {
                draft = propose(reinterpret_cast<NgramIndexObject*>(index), prompt, output, num_tokens, min_n);
            } catch (const std::bad_alloc&) {
                PyErr_NoMemory();
            }
        }
        Py_XDECREF(prompt);
        Py_XDECREF(output);
        if (draft == nullptr) {
            Py_DECREF(drafts);
            return nullptr;
        }
        int failed = 0;
        if (PyList_GET_SIZE(draft) > 0) {
            PyObject* request_id = PyObject_GetAttr(request, string_request_id);
            failed = request_id == nullptr || PyDict_SetItem(drafts, request_id, draft) < 0;
            Py_XDECREF(request_id);
        }
        Py_DECREF(draft);
        if (failed) {
            Py_DECREF(drafts);
            return nullptr;
        }
    }
    return drafts;
}

PyMethodDef module_methods[] = {
    {"propose_batch", propose_batch, METH_VARARGS,
     "propose_batch(wanted, indexes, min_n) -> dict[str, list[int]]: each wanted request's draft, if any"},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef module_definition = {
    PyModuleDef_HEAD_INIT, "tokenmill_ngram_index",
    "The n-gram lookup of engine/spec/ngram.py in C++ (engine/spec/csrc/ngram_index.cpp).", -1, module_methods,
};

}  // namespace

PyMODINIT_FUNC PyInit_tokenmill_ngram_index(void) {
    try {
        std::random_device entropy;
        hash_seed ^= (static_cast<uint64_t>(entropy()) << 32) ^ entropy();
    } catch (...) {  // no entropy source: the process's own addresses (randomised by the loader) still vary
        hash_seed ^= reinterpret_cast<uintptr_t>(&hash_seed) ^ reinterpret_cast<uintptr_t>(&NgramIndexType);
    }
    NgramIndexType.tp_basicsize = sizeof(NgramIndexObject);
    NgramIndexType.tp_flags = Py_TPFLAGS_DEFAULT;
    NgramIndexType.tp_doc = "NgramIndex(min_n, max_n): one request's n-gram index (LazyNgramIndex in C++)";
    NgramIndexType.tp_new = index_new;
    NgramIndexType.tp_dealloc = index_dealloc;
    NgramIndexType.tp_methods = index_methods;
    if (PyType_Ready(&NgramIndexType) < 0) return nullptr;
    string_prompt = PyUnicode_InternFromString("prompt_token_ids");
    string_output = PyUnicode_InternFromString("output_token_ids");
    string_request_id = PyUnicode_InternFromString("request_id");
    if (string_prompt == nullptr || string_output == nullptr || string_request_id == nullptr) return nullptr;
    PyObject* module = PyModule_Create(&module_definition);
    if (module == nullptr) return nullptr;
    Py_INCREF(&NgramIndexType);
    if (PyModule_AddObject(module, "NgramIndex", reinterpret_cast<PyObject*>(&NgramIndexType)) < 0) {
        Py_DECREF(&NgramIndexType);
        Py_DECREF(module);
        return nullptr;
    }
    return module;
}
