;; Reads the process CPU-time clock (id 2) and exits 0 if it is below one second (the
;; job's own CPU time), 5 if above (the reused worker thread's history would leak).
(module
  (import "wasi_snapshot_preview1" "clock_time_get"
    (func $clock_time_get (param i32 i64 i32) (result i32)))
  (import "wasi_snapshot_preview1" "proc_exit" (func $proc_exit (param i32)))
  (memory (export "memory") 1)
  (func (export "_start")
    (if (call $clock_time_get (i32.const 2) (i64.const 1) (i32.const 0))
      (then (call $proc_exit (i32.const 4))))
    (if (i64.ge_u (i64.load (i32.const 0)) (i64.const 1000000000))
      (then (call $proc_exit (i32.const 5))))))
