;; Open "f" in the first preopen (fd 3) 2,000 times without closing; exit with 0 when
;; every open succeeded, else 1. Each open is a descriptor of the worker's own process.
(module
  (import "wasi_snapshot_preview1" "path_open"
    (func $open (param i32 i32 i32 i32 i32 i64 i64 i32 i32) (result i32)))
  (import "wasi_snapshot_preview1" "proc_exit" (func $exit (param i32)))
  (memory (export "memory") 1)
  (data (i32.const 16) "f")
  (func (export "_start")
    (local $i i32)
    (loop $again
      (if (call $open (i32.const 3) (i32.const 0) (i32.const 16) (i32.const 1)
            (i32.const 0) (i64.const 2) (i64.const 2) (i32.const 0) (i32.const 64))
        (then (call $exit (i32.const 1))))
      (local.set $i (i32.add (local.get $i) (i32.const 1)))
      (br_if $again (i32.lt_u (local.get $i) (i32.const 2000))))
    (call $exit (i32.const 0))))
