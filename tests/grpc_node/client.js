'use strict';
// A client of fs3's public gRPC API in another language than the Python client library: it
// follows docs/grpc.md step by step (routing from mgmtd, a lease and request ids from meta, chunk
// ids and chain placement, writes to chain heads with exactly-once fields and the capability,
// close with the length, reads from serving replicas) and uses nothing of fs3 but the .proto files.
//
// tests/test_grpc_node.py runs it against a real cluster. Everything comes from the environment
// (never the command line, which other users of the machine can read):
//   FS3_GRPC_MGMTD   mgmtd's gRPC address (host:port)
//   FS3_TOKEN_FILE   a file whose first non-blank line is the token (a user token fs3u.… here)
//   FS3_PROTO_DIR    the directory holding fs3/*.proto (the copy that ships in the package)
//   FS3_DIR          an absolute fs3 directory to work in (its layout sets the chunk size)
//   FS3_READ_PATH    optional: a file to read and report (written by another client)
//   FS3_WRITE_BYTES  how many bytes to write
// It prints one JSON object with what it saw, and exits non-zero on any failure.

const crypto = require('crypto');
const fs = require('fs');
const os = require('os');
const grpc = require('@grpc/grpc-js');
const protoLoader = require('@grpc/proto-loader');

// fs3.StatusCode values (proto/fs3/common.proto) this client acts on.
const Code = {
  NOT_FOUND: 2, RESOURCE_EXHAUSTED: 6, TIMEOUT: 8, UNAVAILABLE: 9, CHAIN_VERSION_MISMATCH: 10,
  NOT_HEAD: 11, TARGET_NOT_SERVING: 12, CHUNK_NOT_COMMITTED: 13, LEASE_EXPIRED: 16, TXN_CONFLICT: 23,
  MAYBE_COMMITTED: 24,
};
// Storage errors cured by fresh routing (or a moment's wait), sent again with the same fields.
const STORAGE_RETRY = new Set([Code.TIMEOUT, Code.UNAVAILABLE, Code.RESOURCE_EXHAUSTED,
  Code.CHAIN_VERSION_MISMATCH, Code.NOT_HEAD, Code.TARGET_NOT_SERVING, Code.CHUNK_NOT_COMMITTED,
  Code.LEASE_EXPIRED]);
// Meta errors after which the same request (same request id) may be sent again.
const META_RETRY = new Set([Code.TIMEOUT, Code.UNAVAILABLE, Code.RESOURCE_EXHAUSTED, Code.TXN_CONFLICT,
  Code.MAYBE_COMMITTED]);
const NODE_META = 2;                            // fs3.NodeType
const SERVING = 1;                              // fs3.PublicState
const WRITE = 1;                                // fs3.UpdateType
const O_RDONLY = 0, O_WRONLY = 1, O_CREAT = 0o100, O_EXCL = 0o200;   // Linux open(2) flags
const ATTEMPTS_MAX = 20;
const RPC_TIMEOUT_MS = 10000;

function setting(name) {
  const value = process.env[name];
  if (!value) throw new Error(`${name} is not set`);
  return value;
}

function readToken(file) {
  const token = fs.readFileSync(file, 'utf8').split('\n').map((line) => line.trim()).find(Boolean);
  if (!token) throw new Error(`${file} holds no token`);
  return token;
}

const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

// CRC32C (Castagnoli, reflected polynomial 0x82F63B78): every write carries it, every read answers it.
const CRC_TABLE = (() => {
  const table = new Uint32Array(256);
  for (let n = 0; n < 256; n++) {
    let c = n;
    for (let k = 0; k < 8; k++) c = c & 1 ? (c >>> 1) ^ 0x82f63b78 : c >>> 1;
    table[n] = c >>> 0;
  }
  return table;
})();

function crc32c(buf) {
  let crc = 0xffffffff;
  for (let i = 0; i < buf.length; i++) crc = CRC_TABLE[(crc ^ buf[i]) & 0xff] ^ (crc >>> 8);
  return (crc ^ 0xffffffff) >>> 0;
}

// A chunk id: the inode id (u64) then the chunk index (u32), both big-endian (fs3/common/ids.py).
function chunkId(inodeId, index) {
  const id = Buffer.alloc(12);
  id.writeBigUInt64BE(BigInt(inodeId), 0);
  id.writeUInt32BE(index, 8);
  return id;
}

class Fs3Error extends Error {
  constructor(code, grpcCode, details, method) {
    super(`${method}: fs3 code ${code} (gRPC ${grpcCode}): ${details}`);
    this.code = code;          // the fs3 StatusCode from x-fs3-code; null when the transport failed
    this.grpcCode = grpcCode;
  }
}

class Api {
  constructor(protoDir, token) {
    const definition = protoLoader.loadSync(['fs3/mgmtd.proto', 'fs3/meta.proto', 'fs3/storage.proto'], {
      includeDirs: [protoDir], keepCase: true, longs: String, enums: Number, bytes: Buffer, defaults: true,
    });
    this.fs3 = grpc.loadPackageDefinition(definition).fs3;
    this.token = token;
    this.clients = new Map();
  }

  client(service, address) {
    const key = `${service}@${address}`;
    if (!this.clients.has(key)) {
      this.clients.set(key, new this.fs3[service](address, grpc.credentials.createInsecure(), {
        'grpc.max_receive_message_length': 80 * 1024 * 1024,
        'grpc.max_send_message_length': 80 * 1024 * 1024,
      }));
    }
    return this.clients.get(key);
  }

  // One unary call with the token; a failure becomes an Fs3Error carrying the x-fs3-code trailer.
  call(service, address, method, request) {
    const metadata = new grpc.Metadata();
    metadata.set('x-fs3-token', this.token);
    return new Promise((resolve, reject) => {
      this.client(service, address)[method](request, metadata, { deadline: Date.now() + RPC_TIMEOUT_MS },
        (err, response) => {
          if (!err) return resolve(response);
          const code = err.metadata ? err.metadata.get('x-fs3-code')[0] : undefined;
          reject(new Fs3Error(code === undefined ? null : Number(code), err.code, err.details, method));
        });
    });
  }

  close() {
    // The base class's close: on a Meta client `client.close` is the service's Close rpc.
    for (const client of this.clients.values()) grpc.Client.prototype.close.call(client);
  }
}

// mgmtd's routing information: the nodes (and their gRPC addresses), targets and chains.
class Routing {
  constructor(api, mgmtd) {
    this.api = api;
    this.mgmtd = mgmtd;
    this.version = '0';
    this.info = null;
  }

  async refresh() {
    const rsp = await this.api.call('Mgmtd', this.mgmtd, 'GetRoutingInfo', { known_version: this.version });
    if (rsp.changed) {
      this.info = rsp.routing;
      this.version = rsp.routing.routing_version;
    }
    return this.info;
  }

  metaAddress() {
    const metas = this.info.nodes.filter((n) => n.node_type === NODE_META);
    metas.sort((a, b) => (b.alive - a.alive) || (a.node_id - b.node_id));
    if (!metas.length) throw new Error('no meta server in the routing information');
    return metas[0].grpc_address;
  }

  // The chain's version and members, head first, each with its public state and node's address.
  chain(chainId) {
    const chain = this.info.chains.find((c) => c.chain_id === chainId);
    if (!chain) throw new Error(`unknown chain ${chainId}`);
    const members = chain.target_ids.map((targetId) => {
      const target = this.info.targets.find((t) => t.target_id === targetId);
      const node = target && this.info.nodes.find((n) => n.node_id === target.node_id);
      return { targetId, state: target ? target.public_state : 0, address: node ? node.grpc_address : '' };
    });
    return { version: chain.chain_version, members };
  }
}

// The metadata service: a lease for this client id, and a fresh request id per request (kept
// across its retries, so a retried mutation runs once).
class Meta {
  constructor(api, routing) {
    this.api = api;
    this.routing = routing;
    this.clientId = crypto.randomBytes(16);
    this.nextRequest = 1;
    this.renewals = '0';
    this.timer = null;
  }

  async call(method, request, withCtx = true) {
    if (withCtx) request.ctx = { client_id: this.clientId, request_id: String(this.nextRequest++) };
    for (let attempt = 1; ; attempt++) {
      try {
        return await this.api.call('Meta', this.routing.metaAddress(), method, request);
      } catch (err) {
        if (!META_RETRY.has(err.code) && err.code !== null) throw err;
        if (attempt >= ATTEMPTS_MAX) throw err;
        await this.routing.refresh();
        await sleep(50 * attempt);
      }
    }
  }

  async renew() {
    const rsp = await this.call('RenewClient', {
      client_id: this.clientId, hostname: os.hostname(), pid: process.pid,
      completed_below: String(this.nextRequest), renewals: this.renewals,
    }, false);
    this.renewals = rsp.renewals;
    return rsp;
  }

  async start() {
    const rsp = await this.renew();    // registers the client id: before any request that names it
    const everyMs = Math.max(Number(rsp.lease_ms) / 3, 100);
    this.timer = setInterval(() => this.renew().catch((err) => console.error(`lease renewal: ${err.message}`)),
      everyMs);
    this.timer.unref();
    return rsp;
  }

  stop() {
    if (this.timer) clearInterval(this.timer);
  }

  open(path, flags, mode = 0) {
    return this.call('Open', { target: { path: Buffer.from(path) }, flags, mode });
  }

  async lookup(path) {
    return (await this.call('Lookup', { target: { path: Buffer.from(path) }, follow: true })).inode;
  }

  async close(inodeId, sessionId, lengthHint, wrote) {
    return (await this.call('Close', {
      inode_id: inodeId, session_id: sessionId, length_hint: String(lengthHint), wrote, acked: wrote,
    })).inode;
  }

  remove(path) {
    return this.call('Remove', { target: { path: Buffer.from(path) }, directory: false });
  }
}

// Chunk I/O on storage: writes to a chain's head, reads from any serving member.
class Storage {
  constructor(api, routing, clientId) {
    this.api = api;
    this.routing = routing;
    this.clientId = clientId;
    this.seq = 0n;            // channel 1: one update in flight at a time, seq + 1 per update
    this.updates = 0;
    this.retries = 0;
  }

  async update(chainId, chunk, offset, data, chunkSize, capability) {
    this.seq += 1n;
    const request = {
      chain_id: chainId, chunk_id: chunk, type: WRITE, offset, length: data.length, chunk_size: chunkSize,
      checksum: crc32c(data), client_id: this.clientId, channel_id: 1, seq: String(this.seq),
      capability, payload: data,
    };
    const firstMs = Date.now();
    for (let attempt = 1; ; attempt++) {
      const { version, members } = this.routing.chain(chainId);
      const head = members.find((m) => m.state === SERVING || m.state === 2 /* SYNCING */);
      let error;
      if (head && head.state === SERVING) {
        request.chain_version = version;
        request.retry_age_ms = attempt > 1 ? Date.now() - firstMs : 0;
        try {
          const rsp = await this.api.call('Storage', head.address, 'Update', request);
          this.updates++;
          return rsp;
        } catch (err) {
          if (!STORAGE_RETRY.has(err.code) && err.code !== null) throw err;
          error = err;
        }
      } else {
        error = new Error(`chain ${chainId} has no serving head`);
      }
      if (attempt >= ATTEMPTS_MAX) throw error;
      this.retries++;
      await this.routing.refresh();
      await sleep(Math.min(50 * 2 ** attempt, 1000));
    }
  }

  async read(chainId, chunk, offset, length, capability) {
    for (let attempt = 1; ; attempt++) {
      const { version, members } = this.routing.chain(chainId);
      const serving = members.filter((m) => m.state === SERVING);
      let error = new Error(`chain ${chainId} has no serving member`);
      for (let i = 0; i < serving.length; i++) {
        const member = serving[(attempt + i) % serving.length];   // spread reads over the replicas
        try {
          const rsp = await this.api.call('Storage', member.address, 'Read', {
            chain_id: chainId, chain_version: version, chunk_id: chunk, offset, length, capability,
          });
          if (crc32c(rsp.payload) !== rsp.checksum) throw new Error(`chunk ${chunk.toString('hex')}: bad checksum`);
          return rsp.payload;
        } catch (err) {
          if (!STORAGE_RETRY.has(err.code) && err.code !== null) throw err;
          error = err;
        }
      }
      if (attempt >= ATTEMPTS_MAX) throw error;
      this.retries++;
      await this.routing.refresh();
      await sleep(Math.min(50 * 2 ** attempt, 1000));
    }
  }
}

// Write `data` at `offset` of an open file: split at chunk boundaries, chunk i on chains[i % n].
async function writeAt(storage, opened, offset, data) {
  const { inode_id: inodeId, layout } = opened.inode;
  const chunkSize = layout.chunk_size;
  let done = 0;
  while (done < data.length) {
    const position = offset + done;
    const index = Math.floor(position / chunkSize);
    const inChunk = position % chunkSize;
    const piece = data.subarray(done, done + Math.min(chunkSize - inChunk, data.length - done));
    const chainId = layout.chains[index % layout.chains.length];
    await storage.update(chainId, chunkId(inodeId, index), inChunk, piece, chunkSize, opened.capability);
    done += piece.length;
  }
}

// The whole file (its size from meta): a chunk shorter than asked, or missing, reads as zeros.
async function readAll(storage, opened) {
  const { inode_id: inodeId, layout } = opened.inode;
  const size = Number(opened.inode.size);
  const chunkSize = layout.chunk_size;
  const out = Buffer.alloc(size);
  const chains = new Set();
  for (let index = 0; index * chunkSize < size; index++) {
    const want = Math.min(chunkSize, size - index * chunkSize);
    const chainId = layout.chains[index % layout.chains.length];
    chains.add(chainId);
    const got = await storage.read(chainId, chunkId(inodeId, index), 0, want, opened.capability);
    got.copy(out, index * chunkSize);
  }
  return { data: out, chains: [...chains] };
}

const sha256 = (buf) => crypto.createHash('sha256').update(buf).digest('hex');

async function main() {
  const api = new Api(setting('FS3_PROTO_DIR'), readToken(setting('FS3_TOKEN_FILE')));
  const routing = new Routing(api, setting('FS3_GRPC_MGMTD'));
  const dir = setting('FS3_DIR');
  const size = Number(setting('FS3_WRITE_BYTES'));
  const report = {};
  await routing.refresh();
  const meta = new Meta(api, routing);
  const storage = new Storage(api, routing, meta.clientId);
  try {
    const lease = await meta.start();
    report.lease_ms = Number(lease.lease_ms);

    const readPath = process.env.FS3_READ_PATH;
    if (readPath) {
      const opened = await meta.open(readPath, O_RDONLY);
      const { data } = await readAll(storage, opened);
      await meta.close(opened.inode.inode_id, opened.session_id, 0, false);
      report.read_other = { size: data.length, sha256: sha256(data) };
    }

    const data = crypto.randomBytes(size);
    report.sha256 = sha256(data);
    // Two files: one kept for another client to read, one this client also removes.
    for (const name of ['kept.bin', 'node.bin']) {
      const path = `${dir}/${name}`;
      const created = await meta.open(path, O_CREAT | O_EXCL | O_WRONLY, 0o644);
      if (!created.created || !created.capability.length) throw new Error(`${path}: not created with a capability`);
      // Two writes that do not fall on chunk boundaries: a chunk gets two updates.
      const split = Math.floor(size / 2) + 1;
      await writeAt(storage, created, 0, data.subarray(0, split));
      await writeAt(storage, created, split, data.subarray(split));
      const closed = await meta.close(created.inode.inode_id, created.session_id, size, true);
      report[name] = { inode_id: created.inode.inode_id, chunk_size: created.inode.layout.chunk_size,
        chains: created.inode.layout.chains, closed_size: Number(closed.size) };
    }

    const path = `${dir}/node.bin`;
    const stat = await meta.lookup(path);
    report.stat = { size: Number(stat.size), type: stat.type, mode: stat.mode & 0o7777, uid: stat.uid };
    const opened = await meta.open(path, O_RDONLY);
    const { data: back, chains } = await readAll(storage, opened);
    await meta.close(opened.inode.inode_id, opened.session_id, 0, false);
    report.read_back = { size: back.length, sha256: sha256(back), identical: back.equals(data), chains };

    await meta.remove(path);
    try {
      await meta.lookup(path);
      report.after_remove = 'still there';
    } catch (err) {
      report.after_remove = { code: err.code, grpc_code: err.grpcCode };
    }
    report.updates = storage.updates;
    report.retries = storage.retries;
  } finally {
    meta.stop();
    api.close();
  }
  process.stdout.write(`${JSON.stringify(report)}\n`);
}

main().catch((err) => {
  console.error(`fs3 gRPC node client failed: ${err.stack || err}`);
  process.exit(1);
});
