;; Four (unexported) tables, each grown by 1 Mi elements; exit 11..14 at the first grow
;; that fails, 42 when all four grew (4 Mi elements, 32 MiB beside the memory budget).
(module
  (import "wasi_snapshot_preview1" "proc_exit" (func $exit (param i32)))
  (memory (export "memory") 1)
  (table $a 0 funcref) (table $b 0 funcref) (table $c 0 funcref) (table $d 0 funcref)
  (func (export "_start")
    (if (i32.eq (table.grow $a (ref.null func) (i32.const 1048576)) (i32.const -1)) (then (call $exit (i32.const 11))))
    (if (i32.eq (table.grow $b (ref.null func) (i32.const 1048576)) (i32.const -1)) (then (call $exit (i32.const 12))))
    (if (i32.eq (table.grow $c (ref.null func) (i32.const 1048576)) (i32.const -1)) (then (call $exit (i32.const 13))))
    (if (i32.eq (table.grow $d (ref.null func) (i32.const 1048576)) (i32.const -1)) (then (call $exit (i32.const 14))))
    (call $exit (i32.const 42))))
